"""Seeing the conflicts (Sec. 4.1, 5.1; App. 10, Fig. 9): which tokens GTPO protects (lambda = 0 on
the conflict tokens of negative completions) and which it amplifies (lambda = 2 on those of
positive ones).

    ConflictLog       a run's counts of the tokens in conflict spans: by span (forward / backward)
                      and by the sign of the completion's advantage; one bincount over the
                      vocabulary per group (no loop over tokens); saved in checkpoints and
                      written to <output_dir>/conflicts.json
    format_token_ids  the "format" tokens: those of the reward's tag skeleton and the chat
                      template's special tokens
    group_rows        one group as samples.jsonl rows that can be redrawn (tokens, A_i, lambda)
    render_html, render_png   a group drawn like Fig. 9

Draw a logged group:  python eval.py --render runs/<run>/samples.jsonl [--render_step N] [--output_dir D]
"""
import html

import torch

import gtpo
from machinery.data import tagged_solution

# count rows: any = forward OR backward span (sums to the logged n_conflict); then span x sign of A_i
CATEGORIES = ("any", "fwd_pos", "fwd_neg", "bwd_pos", "bwd_neg")
# a token's background by its lambda, whatever the objective's settings: protected (< 1), amplified (> 1), more (> 2)
SHADES = (("λ < 1", "#f4a6a6"), ("λ > 1", "#9fd89f"), ("λ > 2", "#4caf50"))


def color(lam):
    """The background of a token of weight `lam` (None: lambda 1, uncoloured)."""
    if lam is None or lam == 1.0:
        return None
    return SHADES[0][1] if lam < 1 else SHADES[1][1] if lam <= 2 else SHADES[2][1]


def format_token_ids(tok):
    """Token ids that carry the format rather than the reasoning: every token of the reward's tag
    skeleton "<reasoning>\\n\\n</reasoning>\\n<answer>\\n\\n</answer>" as the tokenizer splits it in
    context (tag pieces and the newlines between them), and the tokenizer's special tokens (the
    chat template's end of turn, which ends every completion)."""
    skeleton = tagged_solution({"solution": "", "answer": ""})
    ids = set(tok(skeleton, add_special_tokens=False)["input_ids"]) | set(tok.all_special_ids)
    return torch.tensor(sorted(ids), dtype=torch.long)


class ConflictLog:
    """Accumulated conflict-token counts of one run's RL steps (GTPO or GRPO: the spans exist in both,
    GTPO protects them, GRPO does not)."""

    def __init__(self, vocab_size, format_ids):
        self.counts = torch.zeros(len(CATEGORIES), vocab_size, dtype=torch.long)    # (5, V)
        self.format_ids = format_ids
        self.tokens = 0                                                             # completion tokens seen
        self.format_tokens = 0                                                      # of which format tokens
        self.steps = 0

    def add(self, ids, mask, advantages, group_size):
        """One step: ids, mask (N, L) right-padded; advantages (N,) raw (as for conflict_weights)."""
        ids, mask, advantages = ids.cpu(), mask.cpu(), advantages.cpu()
        V = self.counts.shape[1]
        groups = zip(ids.split(group_size), mask.split(group_size), advantages.split(group_size))
        for g_ids, g_mask, g_adv in groups:
            fwd, bwd = gtpo.conflict_spans(g_ids, g_mask, g_adv)                   # (G, L) each
            pos = (g_adv > 0).unsqueeze(1)                                          # (G, 1)
            for row, sel in zip(self.counts, (fwd | bwd, fwd & pos, fwd & ~pos, bwd & pos, bwd & ~pos)):
                row += torch.bincount(g_ids[sel], minlength=V)
        self.tokens += int(mask.sum())
        self.format_tokens += int(torch.isin(ids[mask.bool()], self.format_ids).sum())
        self.steps += 1

    def state_dict(self):
        return {"counts": self.counts.clone(), "tokens": self.tokens, "format_tokens": self.format_tokens,
                "steps": self.steps}

    def load_state_dict(self, state):
        self.counts, self.tokens, self.steps = state["counts"].clone(), state["tokens"], state["steps"]
        self.format_tokens = state["format_tokens"]

    def summary(self, tok, top=25):
        """The JSON view: totals, the format share of conflict positions, top tokens per category."""
        positions = int(self.counts[0].sum())
        fmt = int(self.counts[0][self.format_ids].sum())
        def top_tokens(row):
            n, idx = row.topk(min(top, int((row > 0).sum())))
            return [[tok.decode([i]), i, c] for i, c in zip(idx.tolist(), n.tolist())]
        return {"rl_steps": self.steps, "completion_tokens": self.tokens, "conflict_positions": positions,
                "conflict_share": positions / max(self.tokens, 1), "format_positions": fmt,
                "format_share": fmt / max(positions, 1),
                "format_share_of_tokens": self.format_tokens / max(self.tokens, 1),
                "format_tokens": [tok.decode([i]) for i in self.format_ids.tolist()],
                "top": {c: top_tokens(row) for c, row in zip(CATEGORIES, self.counts)},
                "categories": "any = forward or backward span; fwd/bwd = span; pos/neg = sign of A_i "
                              "(pos: lambda = 2, amplified; neg: lambda = 0, protected)"}


def group_rows(tok, ro, scored, group, step, question, answer):
    """samples.jsonl rows for one group (`group`: its completions' row numbers) of a step: every
    completion with its token strings, A_i, whether its answer is correct, and lambda per token (GTPO; None for
    GRPO), enough to redraw it with render_*."""
    rows = []
    for i in group:
        n = int(ro.completion_mask[i].sum())
        ids = ro.completion_ids[i, :n].tolist()
        lam = None if scored["weights"] is None else scored["weights"][i, :n].tolist()
        rows.append({"step": step, "question": question, "answer": answer, "completion": ro.texts[i],
                     "reward": scored["rewards"][i].item(), "advantage": scored["advantages"][i].item(),
                     **({"correct": scored["correctness"][i].item() > 0} if "correctness" in scored else {}),
                     "tokens": [tok.decode([t]) for t in ids], "lambda": lam})
    return rows


def pick_group(rows, step=None):
    """The rows of one logged group: of `step`, or the last group that has a conflict token."""
    steps = sorted({r["step"] for r in rows if "tokens" in r})
    if not steps:
        raise ValueError("no redrawable group in these samples (written by an older version, or a GRPO run)")
    if step is None:
        with_conflict = [s for s in steps if any(l != 1.0 for r in rows if r["step"] == s for l in (r["lambda"] or []))]
        step = (with_conflict or steps)[-1]
    if step not in steps:
        raise ValueError(f"no group logged at step {step}; logged steps: {steps}")
    return [r for r in rows if r["step"] == step and "tokens" in r]


def positives_note(rows):
    """What the group's completions with A > 0 were rewarded for: how many are correct, and when none is, that
    their advantage comes from the format alone. None for rows that do not record correctness."""
    pos = [r for r in rows if r["advantage"] > 0]
    if not pos or any("correct" not in r for r in pos):
        return None
    right = sum(r["correct"] for r in pos)
    if right == 0:
        return (f"none of the {len(pos)} completions with A > 0 is correct: they are rewarded for their format "
                f"alone, and their conflict tokens amplified for it")
    return f"{right} of the {len(pos)} completions with A > 0 are correct"


def _show(token):
    return token.replace("\n", "⏎")


def render_html(rows, path):
    """A self-contained HTML page: one completion per line, tokens on the colour of their lambda."""
    legend = " ".join(f'<span style="background:{c}">&nbsp;{words}&nbsp;</span>' for words, c in SHADES)
    lines = []
    for r in rows:
        spans = "".join(f'<span style="background:{color(l) or "transparent"}" title="λ = {l:g}">'
                        f'{html.escape(_show(t))}</span>'
                        for t, l in zip(r["tokens"], r["lambda"] or [1.0] * len(r["tokens"])))
        mark = {True: " ✓", False: " ✗"}.get(r.get("correct"), "")
        lines.append(f'<tr><td class="a">A = {r["advantage"]:+.2f}</td><td class="a">R = {r["reward"]:g}{mark}</td>'
                     f'<td class="t">{spans}</td></tr>')
    q, note = html.escape(rows[0]["question"]), positives_note(rows)
    page = (f'<!doctype html><meta charset="utf-8"><title>GTPO group, step {rows[0]["step"]}</title>'
            '<style>body{font-family:sans-serif} td.t{font-family:monospace;white-space:pre-wrap;padding:4px 0}'
            'td.a{font-family:monospace;white-space:nowrap;vertical-align:top;padding:4px 8px}</style>'
            f'<p><b>Step {rows[0]["step"]}</b>: {q} (answer {html.escape(str(rows[0]["answer"]))})</p>'
            f'<p>{legend} &nbsp; uncoloured: λ = 1; ⏎ = newline; ✓ / ✗ correct or not</p>'
            + (f'<p><b>{html.escape(note)}</b></p>' if note else "")
            + f'<table>{"".join(lines)}</table>')
    with open(path, "w") as f:
        f.write(page)


def render_png(rows, path, width=110):
    """The same group as a PNG (matplotlib, monospace, wrapped at `width` characters)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layout, y = [], 0                                              # (x, y, text, lambda) in character cells
    for r in rows:
        x = 0
        layout.append((-18, y, f"A = {r['advantage']:+.2f}", None))
        for t, l in zip(r["tokens"], r["lambda"] or [1.0] * len(r["tokens"])):
            t = _show(t)
            if x + len(t) > width:
                x, y = 0, y + 1
            layout.append((x, y, t, l))
            x += len(t)
        y += 2
    fig = plt.figure(figsize=(0.06 * (width + 20), 0.2 * (y + 3)))            # ~ a 7 pt monospace cell
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-19, width + 1)
    ax.set_ylim(y + 1, -3)
    ax.axis("off")
    ax.text(-18, -2, f"step {rows[0]['step']}: {rows[0]['question'][:width]}", family="monospace", fontsize=7)
    note = positives_note(rows)
    if note:
        ax.text(-18, -1, note[:width + 18], family="monospace", fontsize=7, weight="bold")
    for x, yy, t, l in layout:
        if color(l):
            ax.add_patch(plt.Rectangle((x, yy - 0.45), len(t), 0.9, color=color(l), lw=0))
        ax.text(x, yy, t, family="monospace", fontsize=7, va="center")
    ax.text(-18, y, "green: λ > 1 (conflict token of a positive completion, amplified; dark: > 2); red: λ < 1 (of a "
            "negative completion, protected); ⏎ newline", family="monospace", fontsize=6, va="center")
    fig.savefig(path, dpi=130)
    plt.close(fig)


def render(samples_path, out_dir, step=None):
    """Both renderings of one logged group -> ([out_dir/group-step<N>.html, .png], positives_note or None)."""
    import os
    from machinery.data import read_jsonl
    rows = pick_group([r for _, r in read_jsonl(samples_path)], step)
    prefix = os.path.join(out_dir, f"group-step{rows[0]['step']}")
    render_html(rows, prefix + ".html")
    render_png(rows, prefix + ".png")
    return [prefix + ".html", prefix + ".png"], positives_note(rows)
