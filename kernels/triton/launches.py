"""What a kernel launch would compile on a GPU, found without one.

`record_launches()` stops every `@triton.jit` kernel launch inside it and keeps it instead: the
kernel, its arguments and its grid (`Launch`). So a wrapper such as
`attention.paged_decode_attention` can be called with CPU tensors of the shapes and strides a
real step has; nothing runs. `specialization(launch)` is the key the JIT caches compiled
variants under (each argument's type, and for integers and pointers whether they are 1 or a
multiple of 16): two launches with the same key run the same binary, two with different keys
compile twice. `compile_launch(launch)` compiles the variant the launch would compile, for
`sm_90` by default, the same way `JITFunction.run` does (the same binder, the same attributes),
and returns Triton's `CompiledKernel`, whose `asm["ptx"]` shows the load widths and the matrix
instructions.

This is how tests/kernels/test_triton_launches.py checks, on a CPU machine, what the
interpreter cannot: that K is loaded in 16-byte vectors, that an fp32 cache does not run its dots
in tf32, that per-step arguments do not recompile. `kernels/aot.py` compiles hand-written
signatures (no divisibility hints, so narrower loads than a real launch); this compiles what a
launch passes.

It needs real `JITFunction`s: kernel modules imported without `TRITON_INTERPRET=1` (the test
suite sets it, so the tests use a subprocess).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["Launch", "compile_launch", "record_launches", "specialization"]


@dataclass(frozen=True)
class Launch:
    kernel: Any  # the JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]  # constexprs and launch options (num_warps, ...)
    grid: tuple[int, ...]

    @property
    def name(self) -> str:
        return str(self.kernel.fn.__name__)

    def arg(self, name: str) -> Any:
        """The value the launch passed for the kernel argument `name`."""
        names = self.kernel.arg_names
        index = names.index(name)
        return self.args[index] if index < len(self.args) else self.kwargs[name]


@contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Inside, kernel launches are recorded into the yielded list and not run."""
    from triton.runtime.jit import JITFunction

    recorded: list[Launch] = []
    original = JITFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        recorded.append(Launch(self, args, kwargs, tuple(grid)))

    JITFunction.run = run  # type: ignore[method-assign]
    try:
        yield recorded
    finally:
        JITFunction.run = original  # type: ignore[method-assign]


def _backend(capability: int) -> tuple[Any, Any]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", capability, 32)
    return target, make_backend(target)


def _bind(launch: Launch, backend: Any) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):
        raise RuntimeError(
            f"{type(kernel).__name__}: not a JITFunction (kernels imported with TRITON_INTERPRET=1)"
        )
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    return binder(*launch.args, **launch.kwargs)  # type: ignore[no-any-return]


def specialization(launch: Launch, capability: int = 90) -> tuple[tuple[str, Any], ...]:
    """The launch's specialisation key: one `(type, attribute)` per kernel argument."""
    _, backend = _backend(capability)
    _, spec, _ = _bind(launch, backend)
    return tuple(tuple(s) for s in spec)


def compile_launch(launch: Launch, capability: int = 90) -> Any:
    """The `CompiledKernel` the launch would compile for `sm_<capability>`."""
    import triton
    from triton.compiler import ASTSource

    target, backend = _backend(capability)
    bound, spec, options = _bind(launch, backend)
    options, signature, constexprs, attrs = launch.kernel._pack_args(
        backend, launch.kwargs, bound, spec, options
    )
    source = ASTSource(launch.kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)
