"""Fault injection from inside the workers: ``TRAINGUARD_CHAOS`` (never active unless set).

A spec is a ``;``-separated list of faults, each ``kind:key=value,key=value``::

    TRAINGUARD_CHAOS='kill:rank=1,step=40;hang:rank=0,step=60,attempt=1;slow:rank=1,factor=3'

======  =====================================================================================
kind    what the selected worker does
======  =====================================================================================
kill    ``kill -9`` itself (``signal=TERM|INT|...`` for another signal) when step ``step``
        begins, or ``after`` seconds after ``trainguard.init()``
hang    freezes: ``SIGSTOP`` itself (``mode=stop``, the default: heartbeats stop too) or
        sleeps forever inside the step (``mode=sleep``: heartbeats go on, the step never ends)
slow    every step from ``step`` (default 0) takes ``factor`` times as long (``factor=3``)
        or ``delay`` seconds longer (``delay=0.2``); the extra time is inside the step
exit    raises ``SystemExit(code)`` (default 1) at step ``step``: a worker that crashes cleanly
sdc     silent data corruption at step ``step``: just before that step's ``optimizer.step()``
        flips bit ``bit`` (0-31 of the element's bytes as a 32-bit word; default 22) or
        multiplies by ``scale`` one element (``index``, default 0) of one parameter
        (``param``: its position in the optimizer's parameters, default 0): its gradient
        (``target=grad``, the default: after DDP's all-reduce, so only this rank's replica
        goes wrong) or the parameter itself (``target=param``); once per process
======  =====================================================================================

Selectors (every one optional): ``rank=R`` (global rank; default every rank; ``rank=*``),
``attempt=A`` (job-wide attempt, default 0 so that the restarted group runs clean;
``attempt=*`` fires in every attempt, e.g. a crash loop), ``node=NAME`` (the agent's node name).
``step=S`` fires once, at the first step numbered ``>= S`` this process runs (a process that
resumed past ``S`` fires at once); ``after=T`` fires ``T`` seconds after ``trainguard.init()``.

The worker API calls :meth:`WorkerChaos.step_begin` / :meth:`WorkerChaos.step_body_done` at
``tg.step()`` boundaries and :meth:`WorkerChaos.step_begin` at ``tg.log()``, so any script that
uses the handle can be faulted. A bad spec is one :class:`ChaosSpecError` line.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from trainguard.core.config import ConfigError
from trainguard.core.contracts import envvars

__all__ = [
    "CHAOS_ENV",
    "KINDS",
    "ChaosSpecError",
    "Fault",
    "WorkerChaos",
    "check_env",
    "parse_spec",
]

CHAOS_ENV = envvars.CHAOS
KINDS = ("kill", "hang", "slow", "exit", "sdc")
_KEYS: dict[str, frozenset[str]] = {
    "kill": frozenset({"rank", "step", "after", "attempt", "node", "signal"}),
    "hang": frozenset({"rank", "step", "after", "attempt", "node", "mode"}),
    "slow": frozenset({"rank", "step", "attempt", "node", "factor", "delay"}),
    "exit": frozenset({"rank", "step", "after", "attempt", "node", "code"}),
    "sdc": frozenset(
        {"rank", "step", "attempt", "node", "target", "bit", "scale", "index", "param"}
    ),
}
_EXAMPLE = "e.g. TRAINGUARD_CHAOS='kill:rank=1,step=40;slow:rank=0,factor=3'"


class ChaosSpecError(ConfigError):
    """A bad ``TRAINGUARD_CHAOS`` spec; the message says which part and how to fix it."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault of a spec (see the module doc)."""

    kind: str
    rank: int | None = None
    """Global rank it applies to; None: every rank."""
    step: int | None = None
    after_s: float | None = None
    attempt: int | None = 0
    """Job-wide attempt it fires in; None: every attempt."""
    node: str | None = None
    signal: int = signal.SIGKILL
    mode: str = "stop"
    factor: float = 1.0
    delay_s: float = 0.0
    code: int = 1
    target: str = "grad"
    bit: int | None = None
    scale: float | None = None
    index: int = 0
    param: int = 0
    text: str = field(default="", compare=False)

    def applies(self, *, rank: int, attempt: int, node: str | None) -> bool:
        return (
            (self.rank is None or self.rank == rank)
            and (self.attempt is None or self.attempt == attempt)
            and (self.node is None or self.node == node)
        )

    def describe(self) -> str:
        who = "every rank" if self.rank is None else f"rank {self.rank}"
        when = (
            f"at step {self.step}"
            if self.step is not None
            else (f"{self.after_s:g} s after init" if self.after_s is not None else "")
        )
        where = "" if self.node is None else f" on node {self.node}"
        attempt = "every attempt" if self.attempt is None else f"attempt {self.attempt}"
        if self.kind == "kill":
            what = f"{who}: kill -{signal.Signals(self.signal).name[3:]} {when}"
        elif self.kind == "hang":
            what = f"{who}: hang ({'SIGSTOP' if self.mode == 'stop' else 'sleep'}) {when}"
        elif self.kind == "slow":
            how = f"x{self.factor:g}" if self.factor != 1.0 else f"+{self.delay_s:g} s"
            what = f"{who}: steps {how} from step {self.step or 0}"
        elif self.kind == "sdc":
            how = f"bit {self.bit} flipped" if self.scale is None else f"scaled x{self.scale:g}"
            what = (f"{who}: {self.target} of parameter {self.param}, element {self.index}: "
                    f"{how} {when}")  # fmt: skip
        else:
            what = f"{who}: exit {self.code} {when}"
        return f"{what}{where}, {attempt}"


def _bad(part: str, why: str) -> ChaosSpecError:
    return ChaosSpecError(f"{CHAOS_ENV}: {part!r}: {why} ({_EXAMPLE})")


def _int(part: str, key: str, raw: str, *, star: bool = False, lo: int = 0) -> int | None:
    if star and raw == "*":
        return None
    try:
        v = int(raw)
    except ValueError:
        v = lo - 1
    if v < lo:
        extra = " or *" if star else ""
        raise _bad(part, f"{key}={raw!r} is not an integer >= {lo}{extra}")
    return v


def _float(part: str, key: str, raw: str, lo: float) -> float:
    try:
        v = float(raw)
    except ValueError:
        v = lo - 1
    if not v >= lo:
        raise _bad(part, f"{key}={raw!r} is not a number >= {lo:g}")
    return v


def _signal(part: str, raw: str) -> int:
    name = raw.upper()
    if name.isdigit():
        return int(name)
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise _bad(part, f"signal={raw!r} is not a signal name (KILL, TERM, INT, ...)") from None


def _sdc_key(part: str, key: str, raw: str, kw: dict[str, object]) -> None:
    """One key of an ``sdc`` fault into ``kw``."""
    if key == "target":
        if raw not in ("grad", "param"):
            raise _bad(part, f"target={raw!r}: use grad or param")
        kw["target"] = raw
    elif key == "bit":
        bit = _int(part, key, raw)
        if bit is not None and bit > 31:
            raise _bad(part, f"bit={raw!r}: a bit of a 32-bit word, 0-31")
        kw["bit"] = bit
    elif key == "scale":
        try:
            kw["scale"] = float(raw)
        except ValueError:
            raise _bad(part, f"scale={raw!r} is not a number") from None
    else:  # index, param
        kw[key] = _int(part, key, raw)


def _check_fault(part: str, kind: str, kw: dict[str, object]) -> None:
    """The keys a fault of ``kind`` needs together."""
    if kind in ("kill", "hang", "exit"):
        if ("step" in kw) == ("after_s" in kw):
            raise _bad(part, f"{kind} needs exactly one of step=S or after=SECONDS")
        if kind == "hang" and kw.get("mode") == "sleep" and "after_s" in kw:
            raise _bad(part, "mode=sleep hangs a step: use step=S (or mode=stop with after=)")
    elif kind == "sdc":
        if "step" not in kw:
            raise _bad(part, "sdc needs step=S (the step whose optimizer step is corrupted)")
        if "bit" in kw and "scale" in kw:
            raise _bad(part, "sdc takes bit=B (flip) or scale=F (multiply), not both")
        if "scale" not in kw:
            kw.setdefault("bit", 22)
    elif "factor" not in kw and "delay_s" not in kw:
        raise _bad(part, "slow needs factor=F (>= 1) or delay=SECONDS")


def parse_spec(spec: str) -> list[Fault]:
    """Parse a spec (see the module doc); raises :class:`ChaosSpecError` on the first bad part."""
    faults: list[Fault] = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        kind, _, rest = part.partition(":")
        kind = kind.strip().lower()
        if kind not in _KEYS:
            raise _bad(part, f"unknown fault {kind!r}; use one of {', '.join(KINDS)}")
        kw: dict[str, object] = {"kind": kind, "text": part}
        for item in (x.strip() for x in rest.split(",")):
            if not item:
                continue
            key, eq, raw = item.partition("=")
            key, raw = key.strip().lower(), raw.strip()
            if not eq or not raw:
                raise _bad(part, f"{item!r} is not key=value")
            if key not in _KEYS[kind]:
                raise _bad(part, f"{kind} takes {', '.join(sorted(_KEYS[kind]))}, not {key!r}")
            if key == "rank":
                kw["rank"] = _int(part, key, raw, star=True)
            elif key == "step":
                kw["step"] = _int(part, key, raw)
            elif key == "attempt":
                kw["attempt"] = _int(part, key, raw, star=True)
            elif key == "after":
                kw["after_s"] = _float(part, key, raw.removesuffix("s"), 0.0)
            elif key == "node":
                kw["node"] = raw
            elif key == "signal":
                kw["signal"] = _signal(part, raw)
            elif key == "mode":
                if raw not in ("stop", "sleep"):
                    raise _bad(part, f"mode={raw!r}: use stop (SIGSTOP) or sleep")
                kw["mode"] = raw
            elif key == "factor":
                kw["factor"] = _float(part, key, raw, 1.0)
            elif key == "delay":
                kw["delay_s"] = _float(part, key, raw.removesuffix("s"), 0.0)
            elif key == "code":
                kw["code"] = _int(part, key, raw)
            else:
                _sdc_key(part, key, raw, kw)
        _check_fault(part, kind, kw)
        faults.append(Fault(**kw))  # type: ignore[arg-type]
    if not faults:
        raise _bad(spec, "no fault in the spec")
    return faults


def check_env() -> list[Fault]:
    """The faults of ``$TRAINGUARD_CHAOS`` (empty when unset); raises ChaosSpecError."""
    spec = os.environ.get(CHAOS_ENV, "").strip()
    return parse_spec(spec) if spec else []


class WorkerChaos:
    """The faults of one worker process (those that apply to its rank, attempt and node)."""

    def __init__(self, faults: list[Fault], *, rank: int, attempt: int, node: str | None) -> None:
        self.rank = rank
        self.faults = [f for f in faults if f.applies(rank=rank, attempt=attempt, node=node)]
        self._fired: set[int] = set()
        self._lock = threading.Lock()
        for i, f in enumerate(self.faults):
            if f.after_s is not None:
                t = threading.Timer(f.after_s, self._fire, args=(i,))
                t.daemon = True
                t.start()

    @classmethod
    def from_env(cls, *, rank: int, attempt: int, node: str | None) -> WorkerChaos | None:
        """None unless ``TRAINGUARD_CHAOS`` is set (and something in it applies here)."""
        spec = os.environ.get(CHAOS_ENV, "").strip()
        if not spec:
            return None
        me = cls(parse_spec(spec), rank=rank, attempt=attempt, node=node)
        return me if me.faults else None

    def _fire(self, i: int) -> None:
        with self._lock:
            if i in self._fired:
                return
            self._fired.add(i)
        f = self.faults[i]
        print(
            f"trainguard chaos: {f.describe()} (this is rank {self.rank}, pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )
        if f.kind == "kill":
            os.kill(os.getpid(), f.signal)
            time.sleep(5)  # a catchable signal may take a moment to be handled
        elif f.kind == "hang":
            if f.mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                while True:
                    time.sleep(3600)
        elif f.kind == "sdc":
            _arm_sdc(f)
        elif f.kind == "exit":
            if threading.current_thread() is threading.main_thread():
                raise SystemExit(f.code)
            os._exit(f.code)  # a timer thread cannot raise into the main thread

    def step_begin(self, step: int) -> None:
        """A step (or a ``tg.log``) at ``step``: fire the step-triggered faults that are due."""
        for i, f in enumerate(self.faults):
            if f.kind != "slow" and f.step is not None and step >= f.step and i not in self._fired:
                self._fire(i)

    def step_body_done(self, step: int, elapsed_s: float) -> None:
        """The step's body took ``elapsed_s``: a slow fault stretches it (inside the step)."""
        extra = 0.0
        for f in self.faults:
            if f.kind == "slow" and step >= (f.step or 0):
                extra += (f.factor - 1.0) * elapsed_s + f.delay_s
        if extra > 0:
            time.sleep(extra)


def corrupt(t: object, f: Fault) -> None:
    """Flip bit ``f.bit`` of (or scale by ``f.scale``) element ``f.index`` of the tensor ``t``
    in place (modulo its size)."""
    import torch

    assert isinstance(t, torch.Tensor)
    flat = t.detach().view(-1)
    i = f.index % flat.numel()
    with torch.no_grad():
        if f.scale is not None:
            flat[i] *= f.scale
            return
        bit = f.bit if f.bit is not None else 22
        size = flat.element_size()
        raw = flat[i : i + 1].view(torch.uint8)  # the element's bytes (little-endian)
        byte, within = divmod(bit % (8 * size), 8)
        raw[byte] ^= 1 << within


def _arm_sdc(f: Fault) -> None:
    """Corrupt, once, the gradient or the parameter ``f.param`` of the next optimizer step
    (a global optimizer step pre-hook: DDP's all-reduce is over by then)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = None

    def hook(opt: object, args: object, kwargs: object) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        if not params:
            return
        p = params[f.param % len(params)]
        t = p if f.target == "param" else p.grad
        if t is None:
            return
        corrupt(t, f)
        if handle is not None:
            handle.remove()

    handle = register_optimizer_step_pre_hook(hook)
