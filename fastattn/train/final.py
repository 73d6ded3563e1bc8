"""The final model of a run or an ensemble: saved, its length penalty chosen on dev, its test
BLEU reported; and the training curves."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastattn import bleu, checkpoint
from fastattn.inference.ensemble import Ensemble
from fastattn.model import Transformer
from fastattn.train import savedir
from fastattn.train.evaluation import bleu_scores, translate
from fastattn.train.run import Run


def finish(run: Run) -> None:
    """Averages the last checkpoints into the final model and scores it (rank 0)."""
    if not run.main:
        return
    args = run.args
    # the run's own: a numbered checkpoint past its end is not
    paths = [p for p in checkpoint.list_checkpoints(args.save_dir)
             if checkpoint.step_of(p) <= run.step][-args.average_last:]
    score_final(run, checkpoint.average_checkpoints(paths), Path(args.save_dir),
                Path(args.metrics), f"averaged the last {len(paths)} checkpoints")
    if args.plot:
        run.guarded(plot_metrics, [args.metrics], args.plot)
        run.log(f"training curves: {args.plot}")


def score_final(run: Run, state: dict[str, Any], save_dir: Path, metrics: Path,
                made: str) -> None:
    """Saves a final model as save_dir/checkpoint_final.pt, chooses its length penalty on dev
    (stored in the checkpoint for translate) and reports its test BLEU under beam search."""
    args = run.args
    final = save_dir / "checkpoint_final.pt"
    run.guarded(savedir.drop_final_records, metrics, run.log)  # a resumed run scores anew
    run.guarded(checkpoint.save_checkpoint, final, state)
    run.log(f"{made} into {final}")
    model, sp, _ = checkpoint.load_model(final, run.device)
    alpha = choose_alpha(run, model, sp, metrics)
    state["meta"]["alpha"] = alpha
    run.guarded(checkpoint.save_checkpoint, final, state)
    name = "test" if "test" in run.splits else "valid"
    split = run.splits[name]
    started = time.time()
    hyps = translate(model, sp, split.text.src, beam=args.beam, alpha=alpha,
                     max_len_b=args.max_len_b, batch_tokens=args.eval_batch_tokens,
                     truecaser=run.source_truecaser, progress=run.progress)
    scores = bleu_scores(hyps, split, args.tgt)
    ratio, _ = bleu.length_ratio(hyps, split.text.tgt)  # final report only, not dev evals
    output = save_dir / f"{name}.hyp.{args.tgt}"
    run.guarded(checkpoint.write_atomically, output, [("\n".join(hyps) + "\n").encode()])
    run.write_metrics({"step": run.step, f"{name}_bleu": scores["bleu"],
                       f"{name}_tok_bleu": scores["tok_bleu"], "alpha": alpha,
                       f"{name}_length_ratio": ratio,
                       "signature": scores["signature"], "time": time.time()}, metrics)
    tokenized = "lowercased, official tokenized references" if split.tokenized_refs \
        is not None else "cased, Moses tokenization with compound splitting"
    run.log(f"{name} ({len(hyps)} sentences, beam {args.beam}, alpha {alpha}, "
            f"{time.time() - started:.0f}s, {ratio:.3f} of the references' "
            f"length), translations in {output}")
    run.log(f"{name} BLEU {scores['bleu']:.2f}  {scores['signature']}")
    run.log(f"{name} tokenized BLEU {scores['tok_bleu']:.2f}  ({tokenized})")
    run.log(f"checkpoint: {final}")


def choose_alpha(run: Run, model: Transformer | Ensemble, sp, metrics: Path) -> float:
    """The --alpha with the best tokenized dev BLEU under beam search (the paper chose its
    length penalty on dev): some models write too short translations at the paper's 0.6."""
    alphas = run.args.alpha
    if len(alphas) == 1:
        return alphas[0]
    dev, found = run.splits["valid"], {}
    for alpha in alphas:
        hyps = translate(model, sp, dev.text.src, beam=run.args.beam, alpha=alpha,
                        max_len_b=run.args.max_len_b,
                        batch_tokens=run.args.eval_batch_tokens,
                        truecaser=run.source_truecaser, progress=run.progress)
        found[alpha] = bleu_scores(hyps, dev, run.args.tgt)["tok_bleu"]
    best = max(alphas, key=found.__getitem__)  # ties: the first given
    run.write_metrics({"step": run.step, "alpha_dev_tok_bleu": found, "alpha": best,
                       "time": time.time()}, metrics)
    run.log("beam dev tokenized BLEU by alpha: "
            + ", ".join(f"{a} {b:.2f}" for a, b in found.items()) + f"; alpha {best}")
    return best


def plot_metrics(metrics: Sequence[str | Path], png: str | Path) -> None:
    """Training loss, learning rate and dev BLEU against updates, from the metrics logs of a run
    or of the members of an ensemble."""
    import matplotlib  # parse_args made sure it is there

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for k, log in enumerate(metrics):
        records = []
        for line in Path(log).read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):  # a line a kill cut short
                records.append(json.loads(line))
        train = [r for r in records if "loss" in r]
        dev = [r for r in records if "dev_bleu" in r]
        who = f"member {k + 1} " if len(metrics) > 1 else ""
        steps = [r["step"] for r in dev]
        axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label=f"{who}train")
        axes[0].plot(steps, [r["dev_loss"] for r in dev], "o-", label=f"{who}dev")
        axes[1].plot([r["step"] for r in train], [r["lr"] for r in train])
        axes[2].plot(steps, [r["dev_bleu"] for r in dev], "o-", label=f"{who}sacreBLEU")
        axes[2].plot(steps, [r["dev_tok_bleu"] for r in dev], "o-", label=f"{who}tokenized")
    axes[0].set(xlabel="update", ylabel="label-smoothed loss per token")
    axes[1].set(xlabel="update", ylabel="learning rate")
    axes[2].set(xlabel="update", ylabel="greedy dev BLEU")
    axes[0].legend()
    axes[2].legend()
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
