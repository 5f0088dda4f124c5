"""The report's section on what the RL trainer trained (``rollout_samples_trained`` events of
every rank): a histogram of each trained sample's staleness, with the bound, and the groups
kept, shrunk and dropped whole by reason."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from html import escape
from typing import Any

from trainguard.core import svg
from trainguard.core.contracts.event_kinds import ROLLOUT_SAMPLES_TRAINED

__all__ = ["samples_section"]


def samples_section(events: Iterable[dict[str, Any]]) -> str:
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
        if isinstance(e.get("bound"), int):
            bound = max(bound or 0, e["bound"])
        for s in e.get("staleness") or []:
            if isinstance(s, int) and not isinstance(s, bool):
                stale[s] += 1
        for g in e.get("group_sizes") or []:
            if isinstance(g, int) and not isinstance(g, bool):
                sizes[g] += 1
        for reason, n in dict(e.get("dropped") or {}).items():
            if isinstance(n, int) and not isinstance(n, bool):
                dropped[str(reason)] += n
        shrunk += int(e.get("shrunk") or 0)
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
