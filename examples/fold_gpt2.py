"""Fold a small random GPT-2 end to end: analyze, fold, verify, save, reload.

    python examples/fold_gpt2.py            # needs: pip install 'normfold[hf]'

Every LayerNorm of GPT-2 reads the residual stream, which only embeddings and output projections
write. Centering those producers makes every LayerNorm input zero-mean, so each LayerNorm becomes
an RMSNorm with the same outputs; γ and β move into the linear layers that read the norms.

With ``stock_compatible=False`` (the whole plan) ln_f's γ/β move into the LM head, which gets a bias
stock GPT-2 does not have: the folded model's ``save_pretrained`` (``normfold.save_pretrained``) warns
that ``GPT2LMHeadModel.from_pretrained`` would drop it, and ``normfold.from_pretrained`` reloads it
exactly. By default (and in ``normfold fold``) a transformers model keeps ln_f's γ/β in its RMSNorm
instead, so stock transformers loads the result.
"""
from __future__ import annotations

import tempfile
import warnings

import torch

import normfold


def main() -> None:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        raise SystemExit("this example needs transformers: pip install 'normfold[hf]'") from exc

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=1000, n_positions=128,
                        bos_token_id=0, eos_token_id=0, attn_implementation="eager")  # what from_pretrained loads
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # trained-looking norms: γ ≠ 1, β ≠ 0
        for name, p in model.named_parameters():
            if ".ln_" in name:
                p.add_(0.2 * torch.randn_like(p))
    example = {"input_ids": torch.randint(0, config.vocab_size, (2, 16)), "use_cache": False}

    report = normfold.analyze(model, example)  # what would fold, and why; the model is untouched
    print(report, end="\n\n")

    folded, report = normfold.fold(model, example, stock_compatible=False)  # proved in float64, or raises
    print(report.verification)
    print("ln_1 of block 0:", folded.transformer.h[0].ln_1)

    # The stored folded weights are float32, rounded once after float64 math: compared in float64 they
    # differ from the original at float32 rounding level (~1e-7), hence the looser tolerance here.
    longer = {"input_ids": torch.randint(0, config.vocab_size, (1, 64)), "use_cache": False}
    result = normfold.verify(model, folded, longer, tolerance=1e-5)
    print("longer input, stored float32 weights:", result)

    with tempfile.TemporaryDirectory() as tmp:
        with warnings.catch_warnings(record=True) as caught:  # stock GPT-2 has no lm_head.bias: it would be dropped
            warnings.simplefilter("always")
            folded.save_pretrained(f"{tmp}/folded")  # normfold.save_pretrained, with the fold's report
        for warning in caught:
            print("warning:", warning.message)
        reloaded = normfold.from_pretrained(f"{tmp}/folded")  # RMSNorms and lm_head.bias restored
        with torch.no_grad():
            diff = (folded(**longer).logits - reloaded(**longer).logits).abs().max().item()
        print(f"reloaded with normfold.from_pretrained: max abs difference {diff}")


if __name__ == "__main__":
    main()
