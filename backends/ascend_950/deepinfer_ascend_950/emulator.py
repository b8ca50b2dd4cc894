"""Run a TileLang-Ascend kernel's own tile program on the CPU with torch.

:func:`compile` takes the ``T.prim_func`` a kernel module builds (the program as TileLang parsed it,
before the ``ascend`` passes) and returns a callable with the calling convention of
``tilelang.compile(..., target="ascend")``: torch tensors in, outputs written in place. It executes the
program's statements one by one: the core grid (``blockIdx.x``) serially, a mixed kernel's two vector
cores (the ``cthread`` sid) each with its own Unified Buffer while the Cube's L1/L0 buffers are shared,
``T.Parallel`` nests vectorised over their loop variables, and TileLang's tile operators (copy, dual copy,
gemm, reduce, fill) by their documented semantics. On-chip buffers start as NaN, GM reads past a tensor's
end read NaN and GM writes past it are dropped (TileLang clamps GM copies), so a kernel that uses memory
it never wrote, or lets padded rows escape, fails its comparison.

What this proves is the kernel's algorithm at the tile level: tiling, indexing, masking, the order of the
online updates, intermediate dtypes. It does not run TileLang's lowering, the AscendC it generates, the
pipeline synchronisation it inserts or the chip: that needs an Ascend 950.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

#: scopes private to one vector core (each AIV of a mixed kernel has its own)
VECTOR_SCOPES = frozenset({"shared", "shared.dyn", "local", "local.fragment", "local.var"})
GM_SCOPE = "global"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
           "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
           "uint16": torch.int64, "uint32": torch.int64,  # held widened: torch lacks their shifts
           "float8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
           "float8_e5m2": torch.float8_e5m2}

_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid, "fabs": torch.abs, "abs": torch.abs, "tanh": torch.tanh,
    "floor": torch.floor, "ceil": torch.ceil, "round": torch.round, "nearbyint": torch.round,
    "isnan": torch.isnan, "trunc": torch.trunc,
}
_BITWISE: dict[str, Callable[[Any, Any], Any]] = {
    "bitwise_and": lambda a, b: a & b, "bitwise_or": lambda a, b: a | b, "bitwise_xor": lambda a, b: a ^ b,
    "shift_left": lambda a, b: a << b, "shift_right": lambda a, b: a >> b,
}
_REDUCE = {"max": lambda x, d: x.amax(d), "min": lambda x, d: x.amin(d), "sum": lambda x, d: x.sum(d),
           "abssum": lambda x, d: x.abs().sum(d), "absmax": lambda x, d: x.abs().amax(d)}
_COMBINE = {"max": torch.maximum, "min": torch.minimum, "sum": torch.add, "abssum": torch.add,
            "absmax": torch.maximum}


class EmulationError(RuntimeError):
    """The program does something the emulator does not model (or a kernel bug it detected)."""


class _Unbound(Exception):
    pass


def torch_dtype(dtype: Any) -> torch.dtype:
    name = str(dtype)
    if name not in _DTYPES:
        raise EmulationError(f"dtype {name} is not emulated")
    return _DTYPES[name]


def _garbage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype)
    return torch.full(shape, -7, dtype=dtype)


def _ints(x: Any) -> Any:
    return x.long() if isinstance(x, torch.Tensor) else int(x)


class _Machine:
    def __init__(self, func: Any):
        self.func = func
        self.env: dict[Any, Any] = {}
        self.storage: dict[tuple[Any, Any], torch.Tensor] = {}
        self.scopes: dict[Any, str] = {}
        self.lanes: list[Any] = [None]  # sid values of the vector cores (None: no cthread)
        self.lane: Any = None
        self.sid_var: Any = None
        self.parallel: list[tuple[Any, int]] = []
        self.mask: torch.Tensor | None = None

    # --- buffers ---------------------------------------------------------------------------------

    def _key(self, buf: Any) -> tuple[Any, Any]:
        scope = self.scopes.get(buf.data, GM_SCOPE)
        if scope in VECTOR_SCOPES:
            if self.lane is None and self.sid_var is not None:
                raise EmulationError(f"{buf.name} (a vector core's buffer) used by the Cube")
            return buf.data, self.lane
        return buf.data, None

    def data(self, buf: Any) -> torch.Tensor:
        key = self._key(buf)
        if key not in self.storage:
            raise EmulationError(f"buffer {buf.name} used outside its allocation")
        return self.storage[key]

    def allocate(self, buf: Any) -> None:
        scope = buf.scope()
        self.scopes[buf.data] = scope
        shape = tuple(int(self.ev(d)) for d in buf.shape)
        lanes = self.lanes if scope in VECTOR_SCOPES else [None]
        for lane in lanes:
            self.storage[(buf.data, lane)] = _garbage(shape, torch_dtype(buf.dtype))

    # --- expressions -----------------------------------------------------------------------------

    def ev(self, e: Any) -> Any:
        kind = type(e).__name__
        method = getattr(self, f"_e_{kind}", None)
        if method is None:
            raise EmulationError(f"expression {kind} is not emulated: {e}")
        return method(e)

    def _e_IntImm(self, e):
        return bool(e.value) if str(e.dtype) == "bool" else int(e.value)

    def _e_FloatImm(self, e):
        return torch.tensor(e.value, dtype=torch_dtype(e.dtype))

    def _e_StringImm(self, e):
        return e.value

    def _e_Var(self, e):
        if e not in self.env:
            raise _Unbound(e.name)
        value = self.env[e]
        return self.ev(value) if type(value).__module__.startswith("tvm") else value

    def _e_SizeVar(self, e):
        return self._e_Var(e)

    def _e_Cast(self, e):
        return self._cast(self.ev(e.value), e.dtype)

    def _cast(self, v: Any, dtype: Any) -> Any:
        dt = torch_dtype(dtype)
        if not isinstance(v, torch.Tensor):
            if not dt.is_floating_point:
                return bool(v) if dt == torch.bool else int(v)
            return torch.tensor(v, dtype=dt)
        if not dt.is_floating_point and v.dtype.is_floating_point:
            v = v.trunc()
        return v.to(torch.int64 if dt in (torch.int32, torch.int16) else dt)

    def _binary(self, e, op: Callable, int_op: Callable | None = None, compare: bool = False):
        a, b = self.ev(e.a), self.ev(e.b)
        if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            return (int_op or op)(a, b)
        dtype = e.a.dtype if compare else e.dtype
        dt = torch_dtype(dtype)
        if not dt.is_floating_point:
            a, b = torch.as_tensor(a), torch.as_tensor(b)
            if dt != torch.bool:
                a, b = a.long(), b.long()
            return op(a, b)
        return op(torch.as_tensor(a).to(dt), torch.as_tensor(b).to(dt))

    def _e_Add(self, e):
        return self._binary(e, lambda a, b: a + b)

    def _e_Sub(self, e):
        return self._binary(e, lambda a, b: a - b)

    def _e_Mul(self, e):
        return self._binary(e, lambda a, b: a * b)

    def _e_Div(self, e):
        if torch_dtype(e.dtype).is_floating_point:
            return self._binary(e, lambda a, b: a / b)
        return self._binary(e, lambda a, b: torch.div(a, b, rounding_mode="trunc"),
                            lambda a, b: (abs(a) // abs(b)) * (1 if (a < 0) == (b < 0) else -1))

    def _e_Mod(self, e):
        return self._binary(e, torch.fmod, lambda a, b: int(math.fmod(a, b)))

    def _e_FloorDiv(self, e):
        return self._binary(e, lambda a, b: torch.div(a, b, rounding_mode="floor"), lambda a, b: a // b)

    def _e_FloorMod(self, e):
        return self._binary(e, torch.remainder, lambda a, b: a % b)

    def _e_Min(self, e):
        return self._binary(e, torch.minimum, min)

    def _e_Max(self, e):
        return self._binary(e, torch.maximum, max)

    def _e_EQ(self, e):
        return self._binary(e, lambda a, b: a == b, compare=True)

    def _e_NE(self, e):
        return self._binary(e, lambda a, b: a != b, compare=True)

    def _e_LT(self, e):
        return self._binary(e, lambda a, b: a < b, compare=True)

    def _e_LE(self, e):
        return self._binary(e, lambda a, b: a <= b, compare=True)

    def _e_GT(self, e):
        return self._binary(e, lambda a, b: a > b, compare=True)

    def _e_GE(self, e):
        return self._binary(e, lambda a, b: a >= b, compare=True)

    def _e_And(self, e):
        return self._binary(e, lambda a, b: a & b, lambda a, b: a and b, compare=True)

    def _e_Or(self, e):
        return self._binary(e, lambda a, b: a | b, lambda a, b: a or b, compare=True)

    def _e_Not(self, e):
        v = self.ev(e.a)
        return ~v if isinstance(v, torch.Tensor) else not v

    def _select(self, cond: Any, a: Any, b: Any, dtype: Any) -> Any:
        if not isinstance(cond, torch.Tensor):
            return self.ev(a) if cond else self.ev(b)
        x, y = self.ev(a), self.ev(b)
        dt = torch_dtype(dtype)
        dt = dt if dt.is_floating_point or dt == torch.bool else torch.int64
        return torch.where(cond, torch.as_tensor(x).to(dt), torch.as_tensor(y).to(dt))

    def _e_Select(self, e):
        return self._select(self.ev(e.condition), e.true_value, e.false_value, e.dtype)

    def _e_BufferLoad(self, e):
        data = self.data(e.buffer)
        idx = tuple(_ints(self.ev(i)) for i in e.indices)
        value = data[idx]
        if value.dim() == 0 and not value.dtype.is_floating_point and value.dtype != torch.bool:
            return int(value)  # a scalar read (a tile's expert id): Python control flow, not a mask
        return value

    def _e_Call(self, e):
        name = str(e.op.name).split(".")[-1]
        if name == "if_then_else":
            return self._select(self.ev(e.args[0]), e.args[1], e.args[2], e.dtype)
        if name == "infinity":
            return torch.tensor(float("inf"), dtype=torch_dtype(e.dtype))
        if name in ("max_value", "min_value"):
            info = torch.finfo(torch_dtype(e.dtype))
            return torch.tensor(info.max if name == "max_value" else info.min, dtype=torch_dtype(e.dtype))
        if name in _UNARY:
            v = torch.as_tensor(self.ev(e.args[0]))
            return _UNARY[name](v.to(torch_dtype(e.args[0].dtype)))
        if name in _BITWISE:
            a, b = (_ints(self.ev(x)) for x in e.args)
            return _BITWISE[name](a, b)
        if name == "reinterpret":
            return _reinterpret(self.ev(e.args[0]), e.args[0].dtype, e.dtype)
        if name == "pow":
            return torch.pow(*(torch.as_tensor(self.ev(a)).to(torch_dtype(e.dtype)) for a in e.args))
        if name == "launch_thread_idx":
            return 0
        raise EmulationError(f"call {e.op.name} is not emulated")

    # --- statements ------------------------------------------------------------------------------

    def run(self, s: Any) -> None:
        kind = type(s).__name__
        method = getattr(self, f"_s_{kind}", None)
        if method is None:
            raise EmulationError(f"statement {kind} is not emulated")
        method(s)

    def _s_SeqStmt(self, s):
        for stmt in s.seq:
            self.run(stmt)

    def _s_Bind(self, s):
        try:
            self.env[s.var] = self.ev(s.value)
        except _Unbound:  # T.Persistent binds its token before the loop variable exists
            self.env[s.var] = s.value
        except EmulationError:
            self.env[s.var] = 0  # thread launches inside vector functions: lanes are vectorised

    def _s_AttrStmt(self, s):
        self.run(s.body)

    def _s_SBlockRealize(self, s):
        self.run(s.block)

    def _s_SBlock(self, s):
        if s.name_hint in ("SIMT_VF", "SIMD_VF") and self.lane is None and self.sid_var is not None:
            self._per_lane(lambda: self._block(s))
        else:
            self._block(s)

    def _block(self, s):
        for buf in s.alloc_buffers:
            self.allocate(buf)
        self.run(s.body)

    def _s_AllocBuffer(self, s):
        self.allocate(s.buffer)

    def _s_DeclBuffer(self, s):
        self.scopes.setdefault(s.buffer.data, s.buffer.scope())

    def _per_lane(self, fn: Callable[[], None]) -> None:
        for lane in self.lanes:
            self.lane = lane
            self.env[self.sid_var] = lane
            try:
                fn()
            finally:
                self.lane = None
                self.env.pop(self.sid_var, None)

    def _s_For(self, s):
        kind = int(s.kind)
        lo, ext = self.ev(s.min), self.ev(s.extent)
        if kind == 4:  # THREAD_BINDING
            tag = s.thread_binding.thread_tag
            if tag == "cthread":
                self.sid_var, self.lanes = s.loop_var, list(range(lo, lo + ext))
                try:
                    self.run(s.body)
                finally:
                    self.sid_var, self.lanes = None, [None]
                return
            self._serial(s, lo, ext)
            return
        if kind in (1, 2):  # PARALLEL, VECTORIZED
            if isinstance(lo, torch.Tensor) or isinstance(ext, torch.Tensor):
                raise EmulationError("a T.Parallel extent that depends on another parallel variable")
            self._parallel(s, lo, ext)
            return
        if isinstance(ext, torch.Tensor):
            raise EmulationError("a serial loop whose extent depends on a parallel variable")
        self._serial(s, lo, ext)

    def _serial(self, s, lo: int, ext: int) -> None:
        try:
            for i in range(lo, lo + ext):
                self.env[s.loop_var] = i
                self.run(s.body)
        finally:  # out of scope: a later Bind must not see the last value
            self.env.pop(s.loop_var, None)

    def _bind_parallel(self) -> None:
        depth = len(self.parallel)
        for pos, (var, ext) in enumerate(self.parallel):
            shape = [1] * depth
            shape[pos] = ext
            self.env[var] = torch.arange(ext).view(shape)

    def _parallel(self, s, lo: int, ext: int) -> None:
        self.parallel.append((s.loop_var, ext))
        mask = self.mask
        self._bind_parallel()
        if lo:
            self.env[s.loop_var] = self.env[s.loop_var] + lo
        try:
            if self.mask is not None:
                self.mask = self.mask.unsqueeze(-1)
            self.run(s.body)
        finally:
            self.parallel.pop()
            self.env.pop(s.loop_var, None)
            self._bind_parallel()
            self.mask = mask

    def _s_IfThenElse(self, s):
        cond = self.ev(s.condition)
        if not isinstance(cond, torch.Tensor):
            if cond:
                self.run(s.then_case)
            elif s.else_case is not None:
                self.run(s.else_case)
            return
        outer = self.mask
        for case, m in ((s.then_case, cond), (s.else_case, ~cond)):
            if case is None:
                continue
            self.mask = m if outer is None else (outer & m)
            try:
                self.run(case)
            finally:
                self.mask = outer

    def _s_BufferStore(self, s):
        scope = self.scopes.get(s.buffer.data, GM_SCOPE)
        if scope in VECTOR_SCOPES and self.lane is None and self.sid_var is not None:
            self._per_lane(lambda: self._store(s))
        else:
            self._store(s)

    def _store(self, s):
        data = self.data(s.buffer)
        idx = [_ints(self.ev(i)) for i in s.indices]
        value = torch.as_tensor(self.ev(s.value))
        if value.dtype.is_floating_point and not data.dtype.is_floating_point:
            value = value.trunc()
        value = value.to(data.dtype)
        tensors = [t for t in (*idx, value, self.mask) if isinstance(t, torch.Tensor)]
        full = torch.broadcast_shapes(*(t.shape for t in tensors))
        if not full:
            data[tuple(idx)] = value
            return
        idx = [torch.as_tensor(i).expand(full) for i in idx]
        value = value.expand(full)
        if self.mask is not None:
            m = self.mask.expand(full)
            idx, value = [i[m] for i in idx], value[m]
        data.index_put_(tuple(idx), value)

    def _s_Evaluate(self, s):
        v = s.value
        if type(v).__name__ != "Call":
            return
        name = str(v.op.name)
        handler = _TILE_OPS.get(name)
        if handler is None:
            if name in ("tl.launch_thread_idx", "tirx.tvm_thread_invariant", "tl.sync_threads"):
                return
            raise EmulationError(f"tile operator {name} is not emulated")
        regions = [a for a in v.args if type(a).__name__ == "Call" and str(a.op.name) == "tl.region"]
        on_vector = any(self.scopes.get(r.args[0].buffer.data, GM_SCOPE) in VECTOR_SCOPES for r in regions)
        if on_vector and self.lane is None and self.sid_var is not None:
            self._per_lane(lambda: handler(self, v))
        else:
            handler(self, v)

    # --- regions ---------------------------------------------------------------------------------

    def region(self, call: Any) -> tuple[Any, list[tuple[int, int]]]:
        """``tl.region(buf[mins], access, *extents)`` -> (buffer, [(start, extent)] per buffer dim)."""
        load = call.args[0]
        mins = [int(self.ev(i)) for i in load.indices]
        extents = [int(self.ev(x)) for x in call.args[2:]]
        extents = [1] * (len(mins) - len(extents)) + extents
        return load.buffer, list(zip(mins, extents))

    def read(self, call: Any) -> torch.Tensor:
        buf, spans = self.region(call)
        data = self.data(buf)
        out = _garbage(tuple(e for _, e in spans), data.dtype)
        src = tuple(slice(s, min(s + e, n)) for (s, e), n in zip(spans, data.shape))
        dst = tuple(slice(0, max(0, min(s + e, n) - s)) for (s, e), n in zip(spans, data.shape))
        out[dst] = data[src]
        return out

    def write(self, call: Any, value: torch.Tensor) -> None:
        buf, spans = self.region(call)
        self.write_spans(buf, spans, value)

    def write_spans(self, buf: Any, spans: list[tuple[int, int]], value: torch.Tensor) -> None:
        data = self.data(buf)
        value = value.reshape(tuple(e for _, e in spans))
        dst = tuple(slice(s, min(s + e, n)) for (s, e), n in zip(spans, data.shape))
        src = tuple(slice(0, max(0, min(s + e, n) - s)) for (s, e), n in zip(spans, data.shape))
        if self.scopes.get(buf.data, GM_SCOPE) != GM_SCOPE and value[src].shape != value.shape:
            raise EmulationError(f"copy past the end of on-chip buffer {buf.name}")
        data[dst] = value[src].to(data.dtype)


def _reinterpret(value: Any, src: Any, dst: Any) -> torch.Tensor:
    """The bits of 32-bit ``value`` read as ``dst``: float32 <-> (u)int32 (integers held widened)."""
    src, dst = str(src), str(dst)
    if src == "float32" and dst in ("uint32", "int32"):
        bits = torch.as_tensor(value).to(torch.float32).view(torch.int32).long()
        return bits & 0xFFFFFFFF if dst == "uint32" else bits
    if src not in ("uint32", "int32") or dst != "float32":
        raise EmulationError(f"reinterpret {src} -> {dst} is not emulated")
    bits = torch.as_tensor(value).long() & 0xFFFFFFFF
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def _copy(m: _Machine, call: Any) -> None:
    src, dst = call.args[0], call.args[1]
    ann = dict(call.annotations)
    value = m.read(src)
    _, dst_spans = m.region(dst)
    dst_shape = tuple(e for _, e in dst_spans)
    if int(ann.get("transpose", 0)):
        value = value.reshape(_squeezed(value.shape)[-2:]).transpose(0, 1)
    ctl = int(ann.get("dual_dst_ctl", 0))
    if ctl:
        _dual(m, src, dst, value, dst_shape, ctl)
        return
    if _squeezed(value.shape) != _squeezed(dst_shape):
        raise EmulationError(f"copy of {tuple(value.shape)} into {dst_shape}")
    m.write(dst, value.reshape(dst_shape))


def _dual(m: _Machine, src: Any, dst: Any, value: torch.Tensor, dst_shape: tuple[int, ...], ctl: int) -> None:
    """One vector core's half of a dual copy: split along the trailing dim ``-2`` (ctl 1) or ``-1`` (2)."""
    if m.lane is None:
        raise EmulationError("T.dual_copy outside a mixed kernel")
    axis = -2 if ctl == 1 else -1
    full, half = value.shape[axis], dst_shape[axis]
    if full == 2 * half:  # L0C/GM (whole tile) -> this core's UB half
        m.write(dst, value.narrow(axis, m.lane * half, half))
        return
    if 2 * full != half:
        raise EmulationError(f"dual copy of {tuple(value.shape)} and {dst_shape} splits no dim in two")
    buf, spans = m.region(dst)
    spans = list(spans)
    start, _ = spans[axis]
    spans[axis] = (start + m.lane * full, full)
    m.write_spans(buf, spans, value)


def _matrix(m: _Machine, call: Any) -> torch.Tensor:
    t = m.read(call)
    return t.reshape(t.shape[-2:]) if t.dim() > 2 else t


def _gemm(m: _Machine, call: Any) -> None:
    a, b = _matrix(m, call.args[0]).float(), _matrix(m, call.args[1]).float()
    if int(m.ev(call.args[3])):
        a = a.T
    if int(m.ev(call.args[4])):
        b = b.T
    acc = a @ b
    if not int(m.ev(call.args[9])):  # accumulate into C
        acc = _matrix(m, call.args[2]).float() + acc
    m.write(call.args[2], acc)


def _reduce(m: _Machine, call: Any) -> None:
    src, dst = call.args[0], call.args[1]
    kind, dim, clear = m.ev(call.args[2]), int(m.ev(call.args[3])), int(m.ev(call.args[4]))
    value = m.read(src)
    out = _REDUCE[kind](value, dim)
    _, spans = m.region(dst)
    out = out.reshape(tuple(e for _, e in spans))
    if not clear:
        out = _COMBINE[kind](m.read(dst).to(out.dtype), out)
    m.write(dst, out)


def _fill(m: _Machine, call: Any) -> None:
    buf, spans = m.region(call.args[0])
    value = torch.as_tensor(m.ev(call.args[1]))
    m.write(call.args[0], value.to(torch_dtype(buf.dtype)).expand(tuple(e for _, e in spans)).clone())


_TILE_OPS: dict[str, Callable[[_Machine, Any], None]] = {
    "tl.tileop.ascend_copy": _copy, "tl.tileop.copy": _copy, "tl.tileop.gemm": _gemm,
    "tl.tileop.reduce": _reduce, "tl.tileop.fill": _fill,
}


class Emulated:
    """A kernel callable like ``tilelang.compile``'s: ``kernel(*tensors)`` writes its outputs in place."""

    def __init__(self, func: Any):
        self.func = func

    def __call__(self, *args: Any) -> None:
        func = self.func
        if len(args) != len(func.params):
            raise TypeError(f"{func.attrs['global_symbol'] if func.attrs else 'kernel'} takes "
                            f"{len(func.params)} arguments, got {len(args)}")
        m = _Machine(func)
        for param, arg in zip(func.params, args):
            buf = func.buffer_map.get(param)
            if buf is None:
                m.env[param] = arg
                continue
            self._bind(m, buf, arg)
        for param, arg in zip(func.params, args):
            buf = func.buffer_map.get(param)
            if buf is not None:
                m.storage[(buf.data, None)] = arg
        m.run(func.body)

    @staticmethod
    def _bind(m: _Machine, buf: Any, arg: Any) -> None:
        if not isinstance(arg, torch.Tensor):
            raise TypeError(f"{buf.name}: expected a tensor, got {type(arg).__name__}")
        if arg.dtype != torch_dtype(buf.dtype):
            raise TypeError(f"{buf.name}: expected {buf.dtype}, got {arg.dtype}")
        if arg.device.type != "cpu" or not arg.is_contiguous():
            raise TypeError(f"{buf.name}: the emulator takes contiguous CPU tensors")
        if arg.dim() != len(buf.shape):
            raise TypeError(f"{buf.name}: expected {len(buf.shape)} dims, got {arg.dim()}")
        for dim, size in zip(buf.shape, arg.shape):
            if type(dim).__name__ in ("Var", "SizeVar"):
                if m.env.setdefault(dim, int(size)) != int(size):
                    raise TypeError(f"{buf.name}: {dim.name} is {m.env[dim]} elsewhere, {size} here")
            elif type(dim).__name__ == "IntImm" and int(dim) != int(size):
                raise TypeError(f"{buf.name}: expected shape {list(buf.shape)}, got {list(arg.shape)}")


def compile(func: Any) -> Emulated:  # noqa: A001  (mirrors tilelang.compile)
    return Emulated(func)
