"""The report's section on what the RL trainer trained (``rollout_samples_trained`` events of
every rank): a histogram of each trained sample's staleness, with the bound, and the groups
kept, shrunk and dropped whole by reason."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from html import escape

from trainguard.core import svg
from trainguard.core.contracts.event_kinds import ROLLOUT_SAMPLES_TRAINED

__all__ = ["samples_section"]


def _ints(v: object) -> list[int]:
    return (
        [x for x in v if isinstance(x, int) and not isinstance(x, bool)]
        if isinstance(v, list)
        else []
    )


def samples_section(events: Iterable[Mapping[str, object]]) -> str:
    """Empty when no rank recorded a trained sample; the bound drawn is the largest the
    records name."""
    bound: int | None = None
    stale: Counter[int] = Counter()
    dropped: Counter[str] = Counter()
    sizes: Counter[int] = Counter()
    shrunk = records = 0
    for e in events:
        if e.get("kind") != ROLLOUT_SAMPLES_TRAINED:
            continue
        records += 1
        b = e.get("bound")
        if isinstance(b, int) and not isinstance(b, bool):
            bound = max(bound or 0, b)
        stale.update(_ints(e.get("staleness")))
        sizes.update(_ints(e.get("group_sizes")))
        d = e.get("dropped")
        for reason, n in d.items() if isinstance(d, dict) else ():
            if isinstance(n, int) and not isinstance(n, bool):
                dropped[str(reason)] += n
        sh = e.get("shrunk")
        shrunk += sh if isinstance(sh, int) else 0
    if not records:
        return ""
    chart = svg.histogram(
        stale,
        title=f"Staleness of each trained sample ({sum(stale.values())} samples, every attempt)",
        xlabel="versions behind the update it trained",
        limit=bound,
    )
    rows = [("groups trained", sum(sizes.values())), ("of them shrunk", shrunk)]
    rows += [(f"groups dropped: {r}", n) for r, n in sorted(dropped.items())]
    rows += [(f"groups of {k} samples", n) for k, n in sorted(sizes.items())]
    table = "".join(f"<tr><td>{escape(k)}</td><td>{v}</td></tr>" for k, v in rows)
    return (
        f'<div class="charts" id="rollout-samples">{chart}</div>'
        f'<table class="tg-rollout-groups">{table}</table>'
    )
