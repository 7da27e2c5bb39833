"""Component classes and models built from their configs: one place for diffusers, transformers and
classes that live in a diffusers pipeline module (model_index.json `["ltx2", "LTX2TextConnectors"]`).

A library name that is neither diffusers nor transformers is looked up inside `diffusers.pipelines`
only, and only when it is a plain identifier naming a module there: a config file never makes dmap
import an arbitrary module.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging

from dm_cli.errors import SourceError
from dm_cli.model.formats.nf4 import import_bitsandbytes_deferring_compile
from dm_cli.model.formats.weight_formats import quiet_torchao

# Keys of a transformers config.json that are bookkeeping, not architecture.
_VOLATILE_KEYS = ("_name_or_path", "transformers_version")


def before_diffusers_import() -> None:
    """What must come before diffusers' first import, which imports torchao and bitsandbytes when they are installed:
    torchao's logs quieted, and bitsandbytes imported with its kernels' compiles waiting for their first use."""
    quiet_torchao()
    import_bitsandbytes_deferring_compile()


def quiet_libraries() -> None:
    """dmap prints its own progress and summary: the libraries' load bars and advice would drown it."""
    before_diffusers_import()
    # transformers: imported on use, so start-up stays free of torch
    import transformers

    transformers.utils.logging.set_verbosity_error()  # diffusers' import triggers transformers warnings
    transformers.utils.logging.disable_progress_bar()
    # diffusers: imported on use, so start-up stays free of torch
    import diffusers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()


def _library_module(library: str | None, class_name: str):
    before_diffusers_import()
    if library in ("diffusers", "transformers"):
        return importlib.import_module(library)
    if isinstance(library, str) and library.isidentifier() and not library.startswith("_"):
        name = f"diffusers.pipelines.{library}"
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            return importlib.import_module(name)
    raise SourceError(
        f"Component class '{class_name}' comes from library '{library}', which is neither diffusers, transformers nor "
        "a diffusers pipeline module: dmap cannot build it."
    )


def component_class(library: str | None, class_name: str):
    """The class a model_index.json entry (library, class) names."""
    module = _library_module(library, class_name)
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        version = getattr(importlib.import_module(module.__name__.split(".")[0]), "__version__", "")
        raise SourceError(f"Class '{class_name}' is not in {module.__name__} {version}: cannot build it.")
    if not _is_model_class(cls):  # never a pipeline, a config class or an Auto* factory named by a file
        raise SourceError(f"'{class_name}' is not a model class (a diffusers ModelMixin or transformers "
                          "PreTrainedModel subclass): dmap builds only models such as UNet2DConditionModel or CLIPTextModel.")
    return cls


def _is_model_class(cls) -> bool:
    # diffusers: imported on use, so start-up stays free of torch
    import diffusers

    return issubclass(cls, diffusers.ModelMixin) or is_transformers_model(cls)


def is_transformers_model(cls) -> bool:
    # transformers: imported on use, so start-up stays free of torch
    import transformers

    return issubclass(cls, transformers.PreTrainedModel)


def build_model(library: str | None, class_name: str, config: dict, device: str | None = None):
    """The model a config describes. device "meta": no memory; "empty": accelerate's empty weights
    (buffers real); None: the class's own random initialisation on the CPU.

    Transformers models are tied explicitly: built on meta or empty, T5 comes out untied (see the
    reference README).
    """
    # torch: imported on use, so start-up stays free of torch
    import torch

    cls = component_class(library, class_name)
    transformers_style = is_transformers_model(cls)

    def construct():
        if transformers_style:
            quiet_rope_config_warnings()
            clean = {k: v for k, v in config.items() if k not in _VOLATILE_KEYS}
            return cls(cls.config_class.from_dict(clean))
        # diffusers: imported on use, so start-up stays free of torch
        from diffusers.utils import logging as diffusers_logging

        # config keys diffusers itself ignores (FLUX.2's vae force_upcast) are not the user's business
        previous = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()
        try:
            return cls.from_config(config)
        finally:
            diffusers_logging.set_verbosity(previous)

    if device == "meta":
        with torch.device("meta"), _skipped_init(transformers_style):
            model = construct()
    elif device == "empty":
        # accelerate: imported on use, so start-up stays free of torch
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            model = construct()
    else:
        model = construct()
    if device is not None and hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def _skipped_init(transformers_style: bool):
    """diffusers' `no_init_weights` for a diffusers model built on meta: its torch.nn.init calls would only
    fill meta tensors, which hold no values (a third of a UNet's build). Transformers models keep theirs
    (their init also fills buffers, and building one on meta is rare: text encoders get no placeholder)."""
    if transformers_style:
        return contextlib.nullcontext()
    # diffusers: imported on use, so start-up stays free of torch
    from diffusers.models.modeling_utils import no_init_weights

    return no_init_weights()


# What transformers says while building a config whose RoPE settings predate its standardisation
# (Qwen-Image's Qwen2_5_VLConfig: `rope_scaling` with `mrope_section`): advice to the model's authors,
# printed on the first build of such a config. Only these messages are dropped, from their own loggers.
_ROPE_NOISE = {
    "transformers.configuration_utils": lambda message: "got `key=rope_scaling` in kwargs but hasn't set it as attribute"
                                                         in message,
    "transformers.modeling_rope_utils": lambda message: message.startswith("Unrecognized keys in `rope_parameters`")
                                                         and message.rstrip().endswith("{'mrope_section'}"),
}


class _DropMessage:
    """A logging filter that drops the records `matches` accepts."""

    def __init__(self, matches):
        self.matches = matches

    def filter(self, record) -> bool:
        try:
            return not self.matches(record.getMessage())
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is left to logging
            return True


def quiet_rope_config_warnings() -> None:
    """Drop transformers' RoPE-standardisation warnings (`_ROPE_NOISE`) for the whole process, once."""
    for name, matches in _ROPE_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(matches))
