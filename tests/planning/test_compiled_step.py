"""The plan's predicted step under `--compile` (issue 55, item 1; step_time.py `compiled`, trace_session.py
`count_fused`): the elementwise ops between two matmuls are one kernel that reads and writes its tensors once, counted
from the trace's own ops, where eager runs each op and writes each intermediate."""

import pytest
from test_step_time import hand_profile

from dm_cli.planning.modes import CompileMode
from dm_cli.planning.time.step_time import CallWork, Traffic, call_terms, compiled


def test_the_trace_counts_a_run_of_elementwise_ops_as_one_kernel_reading_and_writing_once():
    """lin1 -> gelu -> x2 -> +x -> lin2 on 4x8 float32 tensors (128 bytes each). Eager: gelu reads and writes 256,
    the multiply 256, the add 384 (two inputs): 896 bytes in three kernels. Fused: the run reads lin1's output and
    x once and writes its result once, 384 bytes in one kernel."""
    import torch

    from dm_cli.planning.trace.trace_session import _Session

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin1, self.lin2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin2(torch.nn.functional.gelu(self.lin1(x)) * 2 + x)

    with torch.device("meta"):
        model = Block()
        x = torch.empty(4, 8)
    session = _Session(model, track_memory=True, replace_sdpa=True)
    with torch.no_grad(), session:
        session.enter_module("")
        model(x)
        session.exit_module("")
    work = session.work
    assert work["matmul_ops"] == 2 and work["other_bytes"] == 896
    assert work["fused_kernels"] == 1 and work["fused_bytes"] == 384



def test_a_freed_tensors_id_leaves_the_run_without_the_run_keeping_it_alive():
    """Python reuses a freed tensor's id: the run forgets it when the tensor is freed, so a new tensor with that id is
    not taken for one the run made (the compiled step then varied from run to run); a run ended since is untouched."""
    import gc
    import weakref

    import torch

    from dm_cli.planning.trace.trace_session import _Session

    session = _Session(torch.nn.Identity(), track_memory=True, replace_sdpa=True)
    made = torch.empty(4, 8, device="meta")
    key = session.fused_key(made)
    session.fused_made.add(key)
    alive = weakref.ref(made)
    del made
    gc.collect()
    assert alive() is None  # the run held no reference
    assert key not in session.fused_made and key not in session.fused_refs
    kept = torch.empty(2, device="meta")
    session.fused_made.add(session.fused_key(kept))
    session.end_fused_run()
    session.fused_made.add(7)
    del kept
    gc.collect()
    assert session.fused_made == {7}

def test_compiled_step_moves_the_fused_bytes_and_launches_the_fused_kernels():
    """1e9 bytes eager in 1000 ops become 2e8 bytes in 10 kernels beside 5 matmuls: at 1 GB/s elementwise and 1 ms
    per op on this hand-made CPU profile, the memory term goes from 1 s to 0.2 s and the ops from 1 s to 15 ms.
    "regional" keeps the modules outside the block lists eager."""
    work = CallWork(matmul_flops=1e12, attention_flops=0, other_bytes=1e9, ops=1005, weight_bytes=0, matmul_ops=5,
                    fused_bytes=2e8, fused_kernels=10, outside_ops=105, outside_bytes=1e8, outside_fused_bytes=5e7,
                    outside_fused_kernels=2)
    profile = hand_profile(memory_gbps=1e9)  # weights read at no cost: the elementwise bytes alone
    eager = call_terms(work, profile, "bfloat16", Traffic())
    full = call_terms(compiled(work, CompileMode.FULL), profile, "bfloat16", Traffic())
    assert eager["memory"] == pytest.approx(1.0) and full["memory"] == pytest.approx(0.2)
    assert eager["ops"] == pytest.approx(1.005) and full["ops"] == pytest.approx(0.015)
    regional = compiled(work, CompileMode.REGIONAL)  # blocks fused (1.5e8 bytes, 8 kernels), the outside eager (1e8, 105 ops)
    assert regional.other_bytes == pytest.approx(2.5e8) and regional.ops == 5 + 8 + 105
    assert compiled(CallWork(1e12, 0, 1e9, 1005, 0, 5), CompileMode.FULL).other_bytes == 1e9  # no fused counts: eager's


def test_the_plan_predicts_the_compiled_step_or_says_why_it_runs_eager():
    """The demo on one GPU: --compile regional predicts a shorter step than eager, with the mode it predicts for;
    offloaded blocks run eager (accelerate's hooks), and the plan says so."""
    import dm_cli
    from dm_cli.model.demo import ensure_demo

    folder = ensure_demo()
    common = {"height": 64, "width": 64, "profile": "table:rtx-4090", "overhead": "0=0"}
    eager = dm_cli.plan(str(folder), max_memory="0=8GB", **common).predicted_time
    fused = dm_cli.plan(str(folder), max_memory="0=8GB", compile="regional", **common).predicted_time
    assert "compile" not in eager and fused["compile"] == "regional"
    assert fused["step_s"] < eager["step_s"] and fused["step_terms_s"]["memory"] < eager["step_terms_s"]["memory"]
    offloaded = dm_cli.plan(str(folder), max_memory="0=40MB,cpu=8GB", compile="regional", **common).predicted_time
    assert offloaded["compile"] == "none" and "stream from cpu or disk" in offloaded["compile_eager_because"]
