"""The words of dmap's modes, each vocabulary declared once as a `str` Enum: the placement strategy (--strategy,
--device-map), the residency mode (--mode), what --parallel chooses and the layout a plan records (`parallel`), and
--compile's (here, below the plan's prediction that times the step as it compiles and the run's hook that compiles).

A member is its word: equal to it, hashed and printed as it (f-strings, JSON), so that the CLI hands the member Typer
parsed to the core and a plan file reads the same bytes. --parallel none and a plan's layout "split" are one thing
under the CLI's word and the plan file's: no step sharing, the single-process device map (`Parallel.NONE.layout` is
`Layout.SPLIT`, `Layout.SPLIT.choice` is `Parallel.NONE`)."""

from __future__ import annotations

from enum import Enum

from dm_cli.errors import UsageError


class Word(str, Enum):
    """A str Enum printed as its value (Python 3.11 prints a mixed-in member as Class.NAME)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def words(cls) -> tuple[str, ...]:
        """Every value, in declaration order (what messages list)."""
        return tuple(member.value for member in cls)


class Strategy(Word):
    """How the search spreads blocks over GPUs (accelerate's names)."""

    AUTO = "auto"
    SEQUENTIAL = "sequential"
    BALANCED = "balanced"
    BALANCED_LOW_0 = "balanced_low_0"


class Mode(Word):
    """Whether a pipeline's components are loaded all at once (resident) or stage by stage (staged)."""

    AUTO = "auto"
    RESIDENT = "resident"
    STAGED = "staged"


class Layout(Word):
    """How torchrun ranks share each denoising step, as a plan records it (`parallel.layout`)."""

    SPLIT = "split"  # no sharing: one process runs the device map (--parallel none)
    CFG = "cfg"
    CONTEXT = "context"
    CFG_CONTEXT = "cfg+context"
    PIPELINE = "pipeline"

    @property
    def choice(self) -> Parallel:
        """The --parallel word that asks for this layout."""
        return Parallel.NONE if self is Layout.SPLIT else Parallel(self.value)


class Parallel(Word):
    """--parallel: a layout by its CLI word, or auto (the plan chooses among the layouts that fit)."""

    NONE = "none"
    CFG = "cfg"
    CONTEXT = "context"
    CFG_CONTEXT = "cfg+context"
    PIPELINE = "pipeline"
    AUTO = "auto"

    @property
    def layout(self) -> Layout | None:
        """The layout this choice asks for (None: auto, which the plan chooses)."""
        return None if self is Parallel.AUTO else Layout.SPLIT if self is Parallel.NONE else Layout(self.value)


class CompileMode(Word):
    """--compile's words (dm_cli.run.hooks.compile runs them; the plan's prediction times them)."""

    NONE = "none"
    REGIONAL = "regional"
    AUTO = "auto"  # regional where the model declares its repeated blocks, else whole (as regional)
    FULL = "full"


def parse_compile(value, where: str = "--compile") -> CompileMode:
    """--compile / compile= as a CompileMode (None and False: none; True: auto); anything else one sentence."""
    if value is None or value is False:
        return CompileMode.NONE
    if value is True:
        return CompileMode.AUTO
    try:
        return CompileMode(str(value).strip().lower())
    except ValueError:
        raise UsageError(f"{where} must be one of {', '.join(CompileMode.words())}, not {value!r}.") from None
