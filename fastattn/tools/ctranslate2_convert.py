"""Converts a fastattn Transformer to a CTranslate2 model, to benchmark decoding against it.

    python -m fastattn.tools.ctranslate2_convert --checkpoint CKPT --output-dir DIR [--force]

CTranslate2 (`pip install ctranslate2`, the "bench" extra) is never needed to use fastattn; only
this converter and benchmarks/bench_decoding.py import it. The model maps one to one onto
CTranslate2's TransformerSpec: fused QKV and KV projections, post-norm (or pre-norm) layers,
embeddings scaled by √d_model and shared with the output projection (the decoder's embedding
and the projection are the rows of the output vocabulary, CTranslate2's target vocabulary), and
our position table (sinusoids interleaved sin/cos per dimension pair, as in the paper, which
CTranslate2's own default table does not do, or learned positions). Sources given to
CTranslate2 are SentencePiece pieces ending with "</s>", as fastattn's are; those of a model
trained with --truecase come from truecased text (fastattn.Translator does that, and
detruecases translations).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fastattn.checkpoint import CheckpointError, load_model
from fastattn.cli import ArgumentParser, HelpFormatter
from fastattn.model import Transformer


def to_ctranslate2_spec(model: Transformer, sp):
    """The ctranslate2.specs.TransformerSpec of a fastattn Transformer and its vocabulary."""
    from ctranslate2.specs import TransformerSpec

    cfg = model.cfg
    if cfg.key_dim * cfg.heads != cfg.d_model or cfg.value_dim * cfg.heads != cfg.d_model:
        raise ValueError("CTranslate2's Transformer needs d_k = d_v = d_model / heads")
    if (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) != (cfg.pad_id, 1, 2, 3) or [
        sp.id_to_piece(i) for i in range(1, 4)
    ] != ["<unk>", "<s>", "</s>"]:
        raise ValueError("expected SentencePiece special tokens <pad> <unk> <s> </s> at ids 0-3")
    spec = TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers), cfg.heads, pre_norm=cfg.pre_norm
    )
    spec.config.layer_norm_epsilon = model.encoder.layers[0].self_attention_norm.norm.eps

    def tensor(x: torch.Tensor):
        return x.detach().float().cpu().numpy()

    def linear(target, *sources: torch.nn.Linear) -> None:  # several: fused along the outputs
        target.weight = tensor(torch.cat([s.weight for s in sources]))
        target.bias = tensor(torch.cat([s.bias for s in sources]))

    def norm(target, source) -> None:
        target.gamma, target.beta = tensor(source.weight), tensor(source.bias)

    # The decoder reads and writes only the output vocabulary: the embedding's first rows.
    embedding, output = tensor(model.embedding.weight), tensor(model.output_weight)
    positions = model.embedding.positions(0, cfg.max_len)
    for side, stack, weight in ((spec.encoder, model.encoder, embedding),
                                (spec.decoder, model.decoder, output)):
        embeddings = side.embeddings[0] if isinstance(side.embeddings, list) else side.embeddings
        embeddings.weight = weight
        side.position_encodings.encodings = tensor(positions)
        if cfg.pre_norm:
            norm(side.layer_norm, stack.final_norm)
    spec.decoder.projection.weight = output

    for ours, theirs in zip(model.encoder.layers, spec.encoder.layer, strict=True):
        linear(theirs.self_attention.linear[0], ours.self_attention.qkv)
        linear(theirs.self_attention.linear[1], ours.self_attention.out)
        norm(theirs.self_attention.layer_norm, ours.self_attention_norm.norm)
        _feed_forward(theirs.ffn, ours, linear, norm)
    for ours, theirs in zip(model.decoder.layers, spec.decoder.layer, strict=True):
        linear(theirs.self_attention.linear[0], ours.self_attention.qkv)
        linear(theirs.self_attention.linear[1], ours.self_attention.out)
        norm(theirs.self_attention.layer_norm, ours.self_attention_norm.norm)
        linear(theirs.attention.linear[0], ours.cross_attention.q)
        linear(theirs.attention.linear[1], ours.cross_attention.kv)
        linear(theirs.attention.linear[2], ours.cross_attention.out)
        norm(theirs.attention.layer_norm, ours.cross_attention_norm.norm)
        _feed_forward(theirs.ffn, ours, linear, norm)

    vocabulary = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocabulary += [f"<unused{i}>" for i in range(len(vocabulary), cfg.vocab_size)]
    spec.register_source_vocabulary(vocabulary)
    spec.register_target_vocabulary(vocabulary[:cfg.output_size])
    return spec


def _feed_forward(theirs, ours, linear, norm) -> None:
    linear(theirs.linear_0, ours.feed_forward.w1)
    linear(theirs.linear_1, ours.feed_forward.w2)
    norm(theirs.layer_norm, ours.feed_forward_norm.norm)


def convert(model: Transformer, sp, output_dir: str | Path, force: bool = False) -> Path:
    """Writes the CTranslate2 model (float32) to output_dir and returns it."""
    spec = to_ctranslate2_spec(model, sp)
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not force:
        raise FileExistsError(f"{output_dir} is not empty; pass force=True (--force) to overwrite")
    spec.validate()
    spec.optimize(quantization=None)
    output_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(output_dir))
    return output_dir


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m fastattn.tools.ctranslate2_convert",
                            description=__doc__.split("\n\n")[0],
                            formatter_class=HelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint of one fastattn Transformer (not an ensemble)")
    parser.add_argument("--output-dir", required=True,
                        help="where the CTranslate2 model is written")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty output dir")
    args = parser.parse_args(argv)
    try:
        model, sp, meta = load_model(args.checkpoint)
    except CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    if "members" in meta:  # CTranslate2 models are single Transformers
        raise SystemExit(f"error: {args.checkpoint} is an ensemble; convert one of its members "
                         f"({', '.join(meta['members'])})")
    try:
        print(convert(model, sp, args.output_dir, args.force))
    except (ValueError, FileExistsError) as e:  # a shape CTranslate2 lacks; an occupied directory
        raise SystemExit(f"error: {e}") from None
    except ModuleNotFoundError as e:
        raise SystemExit(f"error: converting needs {e.name} (pip install ctranslate2)") from None


if __name__ == "__main__":
    main()
