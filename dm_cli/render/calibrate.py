"""Rendering of `dmap calibrate`: the measured figures in one sentence, each at most 4 significant digits (2,000 us
per message, not 2e+03), and where the profile went."""

from __future__ import annotations

from dm_cli.planning.time.profiles import DeviceProfile
from dm_cli.units import format_figure


def profile_summary(profile: DeviceProfile) -> str:
    """The profile's figures as one sentence for people."""
    def per_dtype(table: dict) -> str:
        return ", ".join(f"{dtype} {format_figure(value)}" for dtype, value in table.items())

    figures = [f"matmul TFLOP/s {per_dtype(profile.matmul_tflops)}",
               f"attention TFLOP/s {per_dtype(profile.attention_tflops)}",
               f"memory {format_figure(profile.memory_gbps)} GB/s",
               f"host copies {format_figure(profile.host_gbps)} GB/s",
               f"link {format_figure(profile.link_gbps)} GB/s ({profile.link})",
               f"{format_figure(profile.op_seconds * 1e6)} us per op"]
    if profile.link_latency_s:
        figures.append(f"{format_figure(profile.link_latency_s * 1e6)} us per message on the link")
    if profile.collective_latency_s:
        figures.append(f"an all-to-all {format_figure(profile.collective_latency_s * 1e6)} us and "
                       f"{format_figure(profile.collective_gbps)} GB/s")
    return f"{profile.name}: {'; '.join(figures)}."


def written_sentence(path: str, default: bool) -> str:
    """Where the profile was written, and who reads it from there."""
    return f"Profile written to {path}" + (" (dmap plan reads it from there)." if default else
                                          f" (dmap plan --profile {path} predicts with it).")
