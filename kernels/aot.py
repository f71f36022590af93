"""Compile every Triton kernel ahead of time for a GPU target, without a GPU.

    python -m triollm.kernels.aot [--arch sm_90] [--module some.module ...]

CI runs this on a CPU-only machine: Triton lowers each kernel to PTX and runs the `ptxas` it
bundles, so a kernel the compiler rejects (a bad op, a layout it cannot lower, too much shared
memory for the target) fails here rather than on the first GPU run. The interpreter tests check
what the kernels compute; this checks that they compile, and prints what each costs on the chip.

What is compiled: the `AOT_SPECS` (`triollm.kernels.triton.AotSpec`) of each kernel module in
`KERNEL_MODULES`, or of the modules given with `--module` instead. A module that fails to import
(or lists no specs), and every kernel that fails to compile, is reported with its error and makes
the exit status 1.

One line per kernel: registers a thread, the shared memory a launch requests, the stack frame
if any (register spills live there, so a non-zero stack on a Triton kernel means spills), and the
compile time. Registers and stack come from the cubin (`cuobjdump --dump-resource-usage`, the
copy bundled with Triton): `CompiledKernel.n_regs` is only filled in when the kernel is loaded
on a device. Shared memory is Triton's own figure (`metadata.shared`, dynamic shared memory).

`TRITON_INTERPRET=1` (set by the test suite) makes `@triton.jit` return interpreter objects at
decoration time, which cannot be compiled; `main` therefore removes it from the environment
before it imports any kernel module, and `compile_spec` refuses interpreter objects with a
message saying so (that happens when the kernel modules were imported earlier in the process).
`main` also compiles into a fresh temporary Triton cache, so the times are real compile times
and nothing is left behind. `compile_all` (for tests and scripts) does neither: it uses the
process's environment as it is.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from triollm.kernels.envs import clear_triton_interpret, triton_cache_dir
from triollm.kernels.triton import AotSpec

__all__ = [
    "KERNEL_MODULES",
    "AotResult",
    "CollectedSpecs",
    "collect_specs",
    "compile_all",
    "compile_spec",
    "main",
]

KERNEL_MODULES = (
    "triollm.kernels.triton.norm",
    "triollm.kernels.triton.rotary",
    "triollm.kernels.triton.attention",
)

_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")


@dataclass(frozen=True)
class AotResult:
    """One kernel's compilation: the resource figures when it compiled, else `error`."""

    name: str
    seconds: float
    registers: int = 0
    shared_bytes: int = 0
    stack_bytes: int = 0  # the stack frame plus local memory; spills land here
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def line(self) -> str:
        if self.error is not None:
            return f"{self.name}  FAILED ({self.seconds:.2f} s): {self.error}"
        spills = f"  stack {self.stack_bytes} B (spills)" if self.stack_bytes else ""
        return (
            f"{self.name:<48} {self.registers:>4} regs  {self.shared_bytes:>6} B shared"
            f"{spills}  {self.seconds:.2f} s"
        )


@dataclass(frozen=True)
class CollectedSpecs:
    specs: list[AotSpec]
    errors: list[str]  # modules that failed to import or hold no AOT_SPECS


def collect_specs(modules: Sequence[str] | None = None) -> CollectedSpecs:
    """The `AOT_SPECS` of `modules` (default `KERNEL_MODULES`)."""
    specs: list[AotSpec] = []
    errors: list[str] = []
    for name in KERNEL_MODULES if modules is None else modules:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # any error while importing (decorating) the kernels
            errors.append(f"{name}: import failed: {type(e).__name__}: {e}")
            continue
        module_specs = getattr(module, "AOT_SPECS", None)
        if not module_specs:
            errors.append(f"{name}: no AOT_SPECS")
            continue
        specs.extend(module_specs)
    return CollectedSpecs(specs, errors)


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack + local bytes) of the one function in `cubin`, from cuobjdump."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        dump = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usages = _USAGE.findall(dump)
    if len(usages) != 1:
        raise RuntimeError(f"expected one function in the cuobjdump output:\n{dump}")
    registers, stack, local = (int(x) for x in usages[0])
    return registers, stack + local


def compile_spec(spec: AotSpec, capability: int = 90) -> AotResult:
    """Compile one spec for `sm_<capability>`; a compiler error becomes the result's `error`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(spec.kernel, JITFunction):
        raise RuntimeError(
            f"{spec.name}: the kernel is a {type(spec.kernel).__name__}, not a JITFunction: its "
            "module was imported with TRITON_INTERPRET=1 set. Compile in a process without it "
            "(`python -m triollm.kernels.aot` removes it before importing the kernels)."
        )
    start = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(fn=spec.kernel, signature=spec.signature, constexprs=spec.constexprs),
            target=GPUTarget("cuda", capability, 32),
            options={"num_warps": spec.num_warps, "num_stages": spec.num_stages},
        )
        seconds = time.perf_counter() - start
        registers, stack = _resource_usage(compiled.asm["cubin"])
    except Exception as e:  # Triton raises several types (CompilationError, PTXASError, ...)
        return AotResult(spec.name, time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
    return AotResult(
        spec.name,
        seconds,
        registers=registers,
        shared_bytes=compiled.metadata.shared,
        stack_bytes=stack,
    )


def compile_all(specs: Iterable[AotSpec] | None = None, capability: int = 90) -> list[AotResult]:
    """Compile `specs` (default: those of `KERNEL_MODULES`) for `sm_<capability>`, in order.
    With the default, a module that fails to import raises `ImportError`."""
    if specs is None:
        collected = collect_specs()
        if collected.errors:
            raise ImportError("; ".join(collected.errors))
        specs = collected.specs
    return [compile_spec(spec, capability) for spec in specs]


def _capability(arch: str) -> int:
    match = re.fullmatch(r"sm_(\d+)a?", arch)
    if match is None:
        raise argparse.ArgumentTypeError(f"{arch!r} is not an architecture like sm_90")
    return int(match.group(1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m triollm.kernels.aot",
        description="Compile the Triton kernels for a GPU target (no GPU needed).",
    )
    parser.add_argument(
        "--arch", type=_capability, default=90, help="target architecture (default sm_90)"
    )
    parser.add_argument(
        "--module",
        action="append",
        dest="modules",
        metavar="MODULE",
        help="compile this module's AOT_SPECS instead of triollm's kernels (repeatable)",
    )
    args = parser.parse_args(argv)
    clear_triton_interpret()  # read when the kernels are decorated (see above)

    collected = collect_specs(args.modules)
    for error in collected.errors:
        print(error)
    results = []
    with tempfile.TemporaryDirectory(prefix="triton-aot-") as cache, triton_cache_dir(cache):
        for spec in collected.specs:
            result = compile_spec(spec, args.arch)
            print(result.line(), flush=True)
            results.append(result)
    compiled = sum(r.ok for r in results)
    failed = len(results) - compiled
    summary = f"{compiled} kernels compiled for sm_{args.arch}"
    if failed:
        summary += f", {failed} failed"
    if collected.errors:
        summary += f", {len(collected.errors)} modules failed to import"
    print(summary)
    return 1 if failed or collected.errors else 0


if __name__ == "__main__":
    sys.exit(main())
