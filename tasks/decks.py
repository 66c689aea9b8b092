"""Flyte Decks for the rollout and score tasks: what a batch looks like, in the Flyte console.

Each deck is one self-contained HTML page: a line of summary numbers, histograms (PNG, inline)
of the sequence reward and the response length, and the first few samples as a table.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Dict, List, Sequence

import numpy as np

from flytekit.deck import DeckField

from models.data.batch import RolloutBatch
from models.stages.samples import conversation_text

DECK_FIELDS = (DeckField.INPUT, DeckField.OUTPUT, DeckField.SOURCE_CODE, DeckField.TIMELINE)
"""Flyte's default decks minus the dependency list: that one runs ``pip list`` in a subprocess
on every task execution (about 1 s each on a 2-core machine, twice per iteration)."""

NUM_SAMPLES = 8
"""Samples shown in a deck."""


def histogram_img(values: Sequence[float], title: str, xlabel: str, bins: int = 20) -> str:
    """An ``<img>`` tag holding a small PNG histogram of ``values``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 2.8), dpi=90)
    ax.hist(np.asarray(values, dtype=np.float64), bins=bins, color="#4a7fb5", edgecolor="white")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("samples")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(title)}" src="data:image/png;base64,{data}"/>'


def samples_table(columns: Dict[str, List], n: int = NUM_SAMPLES) -> str:
    """An HTML table of the first ``n`` rows of ``columns`` (text escaped, floats to 3 decimals)."""
    names = list(columns)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in names)
    rows = []
    for i in range(min(n, len(columns[names[0]]) if names else 0)):
        cells = [columns[c][i] for c in names]
        rows.append("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in cells) + "</tr>")
    # pre-wrap: a transcript's line breaks show (other cells have none)
    return f'<table border="1" cellpadding="4" style="white-space: pre-wrap"><tr>{head}</tr>{"".join(rows)}</table>'


class Transcript(str):
    """A table cell shown as written (line breaks kept), not as a quoted string."""


def _fmt(value) -> str:
    if isinstance(value, Transcript):
        return str(value)
    return f"{value:.3f}" if isinstance(value, float) else repr(value) if isinstance(value, str) else str(value)


def batch_html(batch: RolloutBatch, title: str) -> str:
    """The deck of a batch: summary, reward histogram (when scored), length histogram, samples."""
    t = batch.table
    lengths = batch.response_lengths()
    summary = [f"{batch.num_rows} samples", f"mean response length {lengths.mean():.2f} tokens",
               f"ended with a stop token {np.mean(t.column('is_end').to_numpy(zero_copy_only=False)):.0%}"]
    figures = []
    cols: Dict[str, List] = {"prompt": t.column("prompt").to_pylist(), "response": t.column("response").to_pylist(),
                             "length": lengths.tolist()}
    if "reward" in t.column_names:
        reward = t.column("reward").to_numpy()
        summary.insert(1, f"mean reward {reward.mean():.3f} (std {reward.std():.3f})")
        figures.append(histogram_img(reward, "sequence reward", "reward"))
        cols["reward"] = [float(x) for x in reward]
    figures.append(histogram_img(lengths, "response length", "tokens", bins=max(1, int(lengths.max(initial=0)) + 1)))
    if "episode" in t.column_names:  # multi-turn: the conversation instead of the raw token text
        cols = {"conversation": [Transcript(conversation_text(e)) for e in t.column("episode").to_pylist()],
                **{k: v for k, v in cols.items() if k not in ("prompt", "response")}}
    return (f"<h3>{html.escape(title)}</h3><p>{html.escape(' · '.join(summary))}</p>"
            f"<div>{''.join(figures)}</div><h4>First {min(NUM_SAMPLES, batch.num_rows)} samples</h4>"
            f"{samples_table(cols)}")


def publish(name: str, batch: RolloutBatch) -> None:
    """Add the batch's deck to the running task (shown in the Flyte console under ``name``)."""
    import flytekit

    only_this_task()
    flytekit.Deck(name, batch_html(batch, f"{name}: iteration {batch.metadata.iteration}"))


def only_this_task() -> None:
    """In a local execution, forget the decks of the tasks that ran before this one in the process.

    flytekit shares one list of decks (and one timeline deck) between all the tasks of a local execution,
    and every task with decks renders the whole list again when it writes its own: the n-th such task paid
    for the n before it, so a long local run grew slower every iteration (0.02 s more per iteration on the
    tiny preset, most of the stateless iteration's growth: issue #36, benchmarks/bench_long_run.py). On a
    cluster each task is its own process, and the list holds its own decks only."""
    import flytekit
    from flytekit import FlyteContextManager

    state = FlyteContextManager.current_context().execution_state
    if state is None or not state.is_local_execution():
        return
    params = flytekit.current_context()
    timeline = params.timeline_deck  # the running task's (shared with those before it): its own times from now
    timeline.time_info.clear()
    params.decks.clear()
    params.decks.append(timeline)
