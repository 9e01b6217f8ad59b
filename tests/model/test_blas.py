"""The BLAS choice: probed in children, a crashing or wrong library survived, the winner used.

Crashing and wrong libraries are real shared objects built here with the C compiler (their
``cblas_sgemm`` raises SIGILL, or returns zeros); without a compiler the child's death is
simulated with a probe prefix that kills it. Where qemu-user exists, the probes also run on an
emulated CPU without AVX-512, where the single-target cmeel-openblas build really dies of SIGILL.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvserve_model import blas_candidates, blas_probe
from kvserve_model.blas import REEXEC_MARKER, fast_blas_env, measure_gflops
from kvserve_model.blas_candidates import BlasLibrary, library_env
from kvserve_model.blas_probe import ProbeResult, Selection, probe, select_blas, summary

ROOT = Path(__file__).resolve().parents[2]
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux's")
CHOSEN = select_blas().chosen if sys.platform.startswith("linux") else None
with_fast_blas = pytest.mark.skipif(CHOSEN is None, reason="no fast BLAS runs here")

_DROP = (
    "LD_PRELOAD",
    REEXEC_MARKER,
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "KVSERVE_BLAS_THREADS",
    "KVSERVE_BLAS_LIB",
    "KVSERVE_BLAS_PROBE_PREFIX",
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env["PYTHONPATH"] = str(ROOT)
    return env | extra


def _python(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


_CORRECT = (
    "import numpy as np, mlx.core as mx\n"
    "from kvserve_model.blas import blas_provider\n"
    "a = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)\n"
    "b = np.random.default_rng(1).standard_normal((200, 100)).astype(np.float32)\n"
    "got = np.array(mx.array(a) @ mx.array(b))\n"
    "print(blas_provider(), np.abs(got - a @ b).max() < 1e-3)\n"
)

_FAKE_BLAS = r"""
#include <signal.h>
#include <string.h>
void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta,
                 float *c, int ldc) {
#ifdef CRASH
    raise(SIGILL);
#endif
    for (int i = 0; i < (order == 101 ? m : n); i++)
        memset(c + (long)i * ldc, 0, sizeof(float) * (order == 101 ? n : m));
}
"""


@pytest.fixture(scope="module")
def fake_libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, BlasLibrary]:
    """A BLAS whose sgemm dies of SIGILL and one whose sgemm returns zeros, built here."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not sys.platform.startswith("linux"):
        pytest.skip("needs a C compiler on Linux")
    out = tmp_path_factory.mktemp("fakeblas")
    (out / "fake.c").write_text(_FAKE_BLAS)
    libs = {}
    for name, flags in (("crash", ["-DCRASH"]), ("zeros", [])):
        path = out / f"lib{name}blas.so"
        subprocess.run(
            [cc, "-shared", "-fPIC", "-O1", *flags, "-o", str(path), str(out / "fake.c")],
            check=True,
            capture_output=True,
        )
        libs[name] = BlasLibrary(f"fake-{name}", str(path))
    return libs


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in _DROP:
        monkeypatch.delenv(name, raising=False)
    return tmp_path


# -- the chosen library ----------------------------------------------------------------------


@with_fast_blas
def test_chosen_blas_is_used_and_correct():
    done = _python(fast_blas_env(_clean_env()), "-c", _CORRECT)
    assert done.returncode == 0, done.stderr
    provider, correct = done.stdout.split()
    assert CHOSEN is not None and Path(provider) == Path(CHOSEN.path).resolve()
    assert correct == "True"


@with_fast_blas
def test_thread_count_goes_to_the_chosen_librarys_variable():
    assert CHOSEN is not None
    env = library_env(CHOSEN, _clean_env(KVSERVE_BLAS_THREADS="1"))
    assert env[CHOSEN.threads_var] == "1"
    env = library_env(CHOSEN, _clean_env(KVSERVE_BLAS_THREADS="1", **{CHOSEN.threads_var: "2"}))
    assert env[CHOSEN.threads_var] == "2"  # the library's own setting wins


def test_malloc_tunables_are_added_and_the_operators_win():
    env = blas_candidates.with_malloc_tunables({})
    assert env["GLIBC_TUNABLES"] == (
        f"glibc.malloc.trim_threshold={1 << 30}:glibc.malloc.mmap_threshold={32 << 20}"
        ":glibc.malloc.mmap_max=0"
    )
    given = "glibc.malloc.trim_threshold=4096:glibc.cpu.hwcaps=-AVX512F"
    env = blas_candidates.with_malloc_tunables({"GLIBC_TUNABLES": given})
    assert env["GLIBC_TUNABLES"] == (
        f"{given}:glibc.malloc.mmap_threshold={32 << 20}:glibc.malloc.mmap_max=0"
    )
    assert blas_candidates.with_malloc_tunables(dict(env)) == env  # idempotent


_TRIM = """
from kvserve_model.blas_candidates import _resident_bytes, trim_heap
chunks = [bytearray(1 << 20) for _ in range(256)]  # 256 MiB in the heap, every page touched
del chunks  # freed: the tunables keep it
kept = _resident_bytes()
freed = trim_heap()
print(kept >> 20, freed >> 20, _resident_bytes() >> 20)
"""


@linux
def test_trim_heap_gives_back_what_the_tunables_keep():
    """Under the worker's malloc settings 256 MiB freed stays resident (what a quantized
    model's packed weights do once dequantized); ``trim_heap`` gives it back and says how
    much."""
    env = blas_candidates.with_malloc_tunables(_clean_env())
    done = _python(env, "-c", _TRIM)
    assert done.returncode == 0, done.stderr
    kept, freed, after = (int(x) for x in done.stdout.split())
    assert kept - after >= 200 and freed >= 200, done.stdout


_FAULTS = """
import resource, mlx.core as mx
other = mx.new_stream(mx.cpu)
def work():
    outs = []
    for i in range(8):  # 4-16 MB temporaries on two streams' threads, as a decode's attention
        with mx.stream(other if i % 2 else mx.default_stream(mx.cpu)):
            outs.append(((mx.zeros((1 << 20 + i % 3,)) + i) * 2).sum())
    mx.eval(outs)
    mx.eval((mx.zeros((3 << 23,)) + 1).sum())  # 48 MB: over the largest mmap threshold
work()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    work()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@with_fast_blas
def test_a_process_on_the_chosen_blas_keeps_freed_memory():
    """The variable reaches the process (glibc reads it at start): temporaries freed and
    allocated again are not faulted in again, 48 MB ones too (here: 256,016 minor faults
    without the settings, 245,777 with all but mmap_max, 6 with them)."""
    assert CHOSEN is not None
    done = _python(library_env(CHOSEN, _clean_env()), "-c", _FAULTS)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 8000


@with_fast_blas
def test_ensure_fast_blas_reexecutes_once():
    code = (
        "from kvserve_model.blas import ensure_fast_blas; "
        "s = ensure_fast_blas(); print(s.fast, s.library)"
    )
    done = _python(_clean_env(), "-c", code)
    assert done.returncode == 0, done.stderr
    fast, library = done.stdout.split()
    assert CHOSEN is not None and fast == "True" and Path(library) == Path(CHOSEN.path).resolve()


def test_disabled_or_looping_falls_back_with_a_warning():
    code = (
        "from kvserve_model.blas import ensure_fast_blas; "
        "s = ensure_fast_blas(); print(s.fast, s.detail)"
    )
    done = _python(_clean_env(KVSERVE_FAST_BLAS="0"), "-c", code)
    assert done.stdout.startswith("False disabled"), done.stderr
    if CHOSEN is not None:
        looped = _python(_clean_env(**{REEXEC_MARKER: "1"}), "-c", code)  # marker but no preload
        assert looped.stdout.startswith("False"), looped.stderr


@with_fast_blas
def test_module_launcher_reports_the_library_and_its_speed():
    done = _python(_clean_env(), "-m", "kvserve_model.blas")
    assert done.returncode == 0, done.stderr
    assert "preloaded" in done.stdout and "GFLOPS" in done.stdout


def test_measure_gflops_is_positive():
    assert measure_gflops(n=64, repeats=1) > 0


# -- the same choice every time --------------------------------------------------------------


def _result(name: str, gflops: float, ok: bool = True) -> ProbeResult:
    return ProbeResult(name, f"/lib/{name}.so", ok, "", gflops)


def test_choose_takes_the_preferred_of_the_equally_fast():
    a, b, c = _result("a", 100.0), _result("b", 115.0), _result("c", 60.0)
    assert blas_probe.choose([a, b, c]) == a  # b is within the floor: a comes first
    fast = _result("fast", 100.0 / blas_probe.SPEED_FLOOR + 1)
    assert blas_probe.choose([a, fast]) == fast  # a clearly faster first choice wins
    assert blas_probe.choose([_result("x", 1.0, ok=False), c]) == c
    assert blas_probe.choose([_result("x", 500.0, ok=False)]) is None


def test_a_recorded_choice_stays_until_another_is_twice_as_fast():
    a, b = _result("a", 100.0), _result("b", 100.0 / blas_probe.SPEED_FLOOR + 1)
    assert blas_probe.choose([a, b], recorded="b") == b
    assert blas_probe.choose([a, b], recorded="a") == a  # b's 1.25x lead does not move it
    twice = _result("b", 100.0 / blas_probe.KEEP_FLOOR + 1)
    assert blas_probe.choose([a, twice], recorded="a") == twice
    broken = _result("a", 500.0, ok=False)  # the recorded one now fails: the others choose
    assert blas_probe.choose([broken, b], recorded="a") == b
    assert blas_probe.choose([a, b], recorded="gone") == b  # a library no longer installed


def test_choose_is_stable_under_timing_noise():
    """Two libraries whose speeds straddle SPEED_FLOOR (a 1.25x ratio, as AOCL-BLAS and
    cmeel-openblas did on a CI machine), each probe's figure off by up to 20% either way: a
    first choice may go either way, but once recorded it never moves."""
    rng = np.random.default_rng(0)
    firsts = set()
    for _ in range(2000):
        noise = rng.uniform(0.8, 1.2, size=2)
        results = [_result("first", 100 * noise[0]), _result("second", 125 * noise[1])]
        firsts.add(blas_probe.choose(results).name)
        for recorded in ("first", "second"):
            assert blas_probe.choose(results, recorded=recorded).name == recorded
    assert firsts == {"first", "second"}  # the noise is wide enough to matter


@linux
def test_interleaved_probes_time_every_library_and_agree_with_single_ones():
    """probe_all times the candidates in alternating rounds: each correct one gets a speed,
    and the checks agree with probing it alone."""
    libs = blas_candidates.candidates()
    if not libs:
        pytest.skip("no preloadable BLAS here")
    together = blas_probe.probe_all(libs, _clean_env())
    alone = [probe(lib, _clean_env()) for lib in libs]
    assert [(r.name, r.ok, r.detail) for r in together] == [(r.name, r.ok, r.detail) for r in alone]
    assert all(r.gflops > 0 for r in together if r.ok)


@linux
@with_fast_blas
def test_a_new_environment_on_the_machine_keeps_its_choice(private_cache: Path):
    """The record is per machine and by library name: an environment whose candidate files
    differ (a fresh clone's venv has its own paths) starts from the machine's choice."""
    env = _clean_env(XDG_CACHE_HOME=str(private_cache))
    first = select_blas(env, reprobe=True)
    assert first.chosen is not None
    records = list((private_cache / "kvserve" / "blas").glob("machine-*.json"))
    assert len(records) == 1 and first.chosen.name in records[0].read_text()
    for choice in (private_cache / "kvserve" / "blas").glob("choice-*.json"):
        choice.unlink()  # as if another venv: no cached choice for these files
    again = select_blas(env)
    assert not again.cached and again.chosen == first.chosen


@linux
@with_fast_blas
def test_every_probe_and_every_start_choose_the_same_library(private_cache: Path):
    """Probing again (a new machine, KVSERVE_BLAS_REPROBE=1) and a start in another process
    come to the same library as this test run's: what failed in a run where timing alone
    decided between AOCL-BLAS and Debian's OpenBLAS."""
    env = _clean_env(XDG_CACHE_HOME=str(private_cache))
    chosen = {select_blas(env, reprobe=True).chosen for _ in range(2)}
    assert len(chosen) == 1
    (lib,) = chosen
    code = "from kvserve_model.blas import select_blas; print(select_blas().chosen.path)"
    done = _python(env, "-c", code)
    assert done.returncode == 0, done.stderr
    assert lib is not None and done.stdout.strip() == lib.path


# -- crashing and wrong libraries ------------------------------------------------------------


def test_probe_survives_a_child_killed_by_sigill(private_cache: Path):
    """Simulated, so it runs on any CPU without a compiler: the probe's command dies of SIGILL."""
    lib = BlasLibrary("doomed", "/nonexistent/libdoomed.so")
    env = _clean_env(KVSERVE_BLAS_PROBE_PREFIX="sh -c 'kill -ILL $$'")
    result = probe(lib, env)
    assert not result.ok and result.detail.startswith("killed by SIGILL")
    assert "instruction this CPU lacks" in result.detail


def test_summary_says_why_and_what_it_costs():
    good = BlasLibrary("good", "/x/libgood.so")
    crashed = ProbeResult("bad", "/x/libbad.so", False, "killed by SIGILL (...)")
    fine = ProbeResult("good", "/x/libgood.so", True, "cfg", 95.0)
    line = summary(Selection(good, (crashed, fine)))
    assert line is not None and "bad killed by SIGILL" in line and "using good (95 GFLOPS" in line
    line = summary(Selection(None, (crashed,)))
    assert line is not None and "reference BLAS" in line and "GFLOPS" in line and "SIGILL" in line
    assert summary(Selection(good, (fine,))) is None  # nothing failed: nothing to warn about


@linux
def test_a_crashing_and_a_wrong_library_are_rejected(fake_libs, private_cache: Path):
    crashed = probe(fake_libs["crash"], _clean_env())
    assert not crashed.ok and crashed.detail.startswith("killed by SIGILL"), crashed
    wrong = probe(fake_libs["zeros"], _clean_env())
    assert not wrong.ok and wrong.detail.startswith("wrong results"), wrong


@linux
def test_selection_skips_a_crashing_library_for_one_that_works(
    fake_libs, private_cache: Path, monkeypatch: pytest.MonkeyPatch
):
    real = [lib for lib in blas_candidates.candidates() if probe(lib, _clean_env()).ok]
    if not real:
        pytest.skip("no real BLAS works here to fall back to")
    monkeypatch.setattr(
        blas_probe, "candidates", lambda: [fake_libs["crash"], fake_libs["zeros"], real[0]]
    )
    chosen = select_blas(_clean_env(), reprobe=True)
    assert chosen.chosen == real[0]
    assert [r.ok for r in chosen.results] == [False, False, True]
    cached = select_blas(_clean_env())  # the second start reads the choice, probes nothing
    assert cached.cached and cached.chosen == real[0]


@linux
def test_worker_process_survives_an_explicit_crashing_library(fake_libs, private_cache: Path):
    """KVSERVE_BLAS_LIB names a library that dies: the process runs on, on reference BLAS."""
    env = _clean_env(KVSERVE_BLAS_LIB=fake_libs["crash"].path, XDG_CACHE_HOME=str(private_cache))
    done = _python(env, "-m", "kvserve_model.blas")
    assert done.returncode == 0, done.stderr
    assert "MLX's reference BLAS" in done.stdout and "GFLOPS" in done.stdout
    assert "SIGILL" in done.stderr and "reference BLAS" in done.stderr
    assert len([ln for ln in done.stderr.splitlines() if "WARNING" in ln]) == 1


# -- a CPU without AVX-512 (emulated) ---------------------------------------------------------

QEMU = shutil.which("qemu-x86_64") if platform.machine() == "x86_64" else None


@pytest.mark.slow
@pytest.mark.skipif(QEMU is None, reason="needs qemu-user on x86-64 (apt install qemu-user)")
def test_on_a_cpu_without_avx512_a_portable_blas_is_chosen_and_correct(private_cache: Path):
    """qemu's Haswell has AVX2 and no AVX-512, like the AMD EPYC VMs where cmeel-openblas's
    SKYLAKEX build died of SIGILL: the probe must reject it there and pick a library that runs."""
    prefix = f"{QEMU} -cpu Haswell"
    selection = select_blas(_clean_env(KVSERVE_BLAS_PROBE_PREFIX=prefix), reprobe=True)
    by_name = {r.name: r for r in selection.results}
    cmeel = by_name.get("cmeel-openblas")
    if cmeel is not None and "SKYLAKEX" in _config(cmeel.path):
        assert not cmeel.ok and "SIGILL" in cmeel.detail, cmeel
    assert selection.chosen is not None, selection.results
    env = library_env(selection.chosen, _clean_env())
    emulated = subprocess.run(
        [QEMU, "-cpu", "Haswell", sys.executable, "-c", _CORRECT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert emulated.returncode == 0, emulated.stderr[-2000:]
    assert emulated.stdout.split()[-1] == "True"


def _config(path: str) -> str:
    lib = next(c for c in blas_candidates.candidates() if c.path == path)
    code = "from kvserve_model.blas import library_config; print(library_config())"
    return _python(library_env(lib, _clean_env()), "-c", code).stdout


@linux
def test_an_explicit_library_finds_its_vendored_dependencies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Wheels vendor a library's dependencies next to it under hashed names, with no RPATH
    (aoclda.libs/libomp-75ed4440.so): KVSERVE_BLAS_LIB pointing there must still load. The
    names come from the ELF dynamic section, wherever patchelf moved its string table."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler")
    (tmp_path / "dep.c").write_text("int vendored_dep(void) { return 7; }\n")
    (tmp_path / "user.c").write_text(
        "int vendored_dep(void); int user(void) { return vendored_dep(); }\n"
    )
    dep = tmp_path / "libdep-0123abcd.so"
    user = tmp_path / "libuser.so"
    soname = f"-Wl,-soname,{dep.name}"  # as auditwheel names a vendored copy
    subprocess.run(
        [cc, "-shared", "-fPIC", soname, "-o", str(dep), str(tmp_path / "dep.c")], check=True
    )
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(user), str(tmp_path / "user.c"), str(dep)],
        check=True,
    )
    assert dep.name in blas_candidates.needed_libraries(str(user))
    assert blas_candidates.needed_libraries(str(tmp_path / "dep.c")) == []  # not an ELF file
    # Files that are no library: empty (cannot be mapped), cut short, missing.
    (tmp_path / "empty.so").write_bytes(b"")
    (tmp_path / "cut.so").write_bytes(user.read_bytes()[:0x30])
    for name in ("empty.so", "cut.so", "missing.so"):
        assert blas_candidates.needed_libraries(str(tmp_path / name)) == []
    monkeypatch.setenv("KVSERVE_BLAS_LIB", str(user))
    (lib,) = blas_candidates.candidates()
    assert lib.library_dirs == (str(tmp_path),)
    env = library_env(lib, _clean_env())
    done = _python(env, "-c", "import ctypes; print(ctypes.CDLL(None).user())")
    assert done.returncode == 0 and done.stdout.strip() == "7", done.stderr


@linux
def test_every_candidate_found_here_is_described_completely():
    """Each candidate's own dependencies resolve (the probe's child can load it)."""
    for lib in blas_candidates.candidates():
        env = library_env(lib, _clean_env())
        done = _python(env, "-c", "pass")
        assert done.returncode == 0, (lib, done.stderr)
