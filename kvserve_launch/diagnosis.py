"""What a child's exit status means, and what to try: the launcher's words for a failure.

A negative status is the signal that killed the child (``subprocess`` reports death by
SIGILL as -4); 66, 69 and 78 are the expected startup failures that the services report
themselves (``kvserve_launch.startup.Failure``); anything else is the child's own status.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

from kvserve_launch.config import ENV_PREFIX, LaunchConfig
from kvserve_launch.startup import Failure, setting

# What the signal means, where strsignal's words ("Killed") say too little.
SIGNAL_MEANING = {
    signal.SIGILL: "illegal instruction",
    signal.SIGKILL: "killed unconditionally",
    signal.SIGSEGV: "invalid memory access",
    signal.SIGABRT: "aborted",
    signal.SIGBUS: "bus error",
    signal.SIGFPE: "arithmetic error",
    signal.SIGTERM: "asked to stop",
    signal.SIGINT: "interrupted",
}


def describe_exit(returncode: int) -> str:
    """``killed by SIGILL (illegal instruction)``, ``exited with status 69 (port in use)``."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"killed by signal {-returncode}"
        meaning = SIGNAL_MEANING.get(sig) or (signal.strsignal(sig) or "").lower()
        return f"killed by {sig.name}" + (f" ({meaning})" if meaning else "")
    try:
        return f"exited with status {returncode} ({Failure(returncode).meaning})"
    except ValueError:
        return f"exited with status {returncode}"


def hint(returncode: int, port_setting: str = "", oom: bool = False) -> str | None:
    """What to try after a child exited with ``returncode``; None where nothing is known.
    ``port_setting`` names the launcher's flags for the child's port(s); ``oom``: the kernel
    says it killed the child for memory (:func:`oom_killed`). A SIGKILL without that evidence
    gets no out-of-memory hint: ``kill -9`` is a SIGKILL too."""
    blas = (
        "KVSERVE_FAST_BLAS=0 runs MLX on its own BLAS, KVSERVE_BLAS_LIB=/path/lib.so names "
        "the library to use (else the worker probes for one that runs here: docs/blas.md)"
    )
    ports = port_setting or "the port flags"
    return {
        -signal.SIGILL: "the CPU lacks an instruction that a native library was built for: " + blas,
        -signal.SIGKILL: "the kernel's out-of-memory killer ended it: lower "
        "KVWORKER_KV_MEMORY_MB (the worker's --kv-memory-mb) or "
        f"{setting(ENV_PREFIX, 'num_blocks')}, run fewer workers, or use a smaller model"
        if oom
        else "another process sent it SIGKILL, or the kernel's out-of-memory killer did "
        "(`dmesg` says which)",
        -signal.SIGSEGV: f"a native library crashed; to rule out the preloaded BLAS: {blas}",
        Failure.PORT_IN_USE: "another process holds the port (is another kvserve running?): "
        f"stop it, or set {ports} (0: any free port)",
        Failure.MODEL: f"{setting(ENV_PREFIX, 'model')} takes {LaunchConfig().model} (the "
        "default, converted locally), a model directory (config.json, *.safetensors, "
        "tokenizer), a .gguf file or a Hugging Face id, of an architecture mlx-lm supports",
    }.get(returncode)


def oom_killed(pid: int, baseline: int | None = None) -> bool:
    """Whether the kernel says it killed ``pid`` for memory: the kernel log names the pid
    (``dmesg``, where this user may read it), or this cgroup's ``oom_kill`` count rose past
    ``baseline`` (:func:`oom_kills`, read when the system started)."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        log = ""
    if re.search(rf"Killed process {pid}\b", log):
        return True
    now = oom_kills()
    return baseline is not None and now is not None and now > baseline


def oom_kills() -> int | None:
    """This cgroup's count of processes the kernel killed for memory (cgroup v2's
    ``memory.events``), or None where it cannot be read."""
    try:
        text = Path("/sys/fs/cgroup/memory.events").read_text()
    except OSError:
        return None
    found = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(found.group(1)) if found else None
