"""transformers' Qwen3-Next with this package's layers (apply_context_parallel) against its own
layers, on one GPU: error against a float32 reference, and fwd+bwd throughput.

    python -m benchmarks.bench_qwen3_next [--tokens 16384] [--seqs 8] [--runs N] [--forms FORM ...] [--out DIR]
    python -m benchmarks.bench_qwen3_next --smoke --out DIR     # tiny shapes on the CPU, seconds

Results (benchmarks/runner.py): ``qwen3-next`` and ``qwen3-next-checks`` (``qwen3-next-smoke...``
with --smoke, which compiles with the ``aot_eager`` backend and fails unless the check holds).
docs/transformers.md, section "Benchmark", gives the model, the forms and the check.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import torch

from benchmarks.cases import random_lengths
from benchmarks.runner import Result, add_out_argument, checks_off, emit, fla_environment
from benchmarks.timing import median_ms_counted
from custom_ops.testing import rel_error

SIZES = {
    "full": dict(
        hidden_size=2048, intermediate_size=5632, vocab_size=32000, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128,
    ),
    "smoke": dict(
        hidden_size=64, intermediate_size=96, vocab_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
}  # fmt: skip
MAX_ERROR_RATIO = 2.0
FORMS = ("ours, compiled", "ours, eager", "hf, looped", "hf, packed")


def make_config(sizes: dict):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **sizes, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_experts=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip


def build_model(config, seed: int = 0):
    """A random Qwen3NextForCausalLM in float32 with its zero-initialised norm weights random."""
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.normal_(0.0, 0.1)
    return model


@contextlib.contextmanager
def torch_delta_rule(enabled: bool):
    """While active (when ``enabled``), transformers' Qwen3-Next runs its torch delta rule instead
    of the kernel it picked at import (FLA's, which needs CUDA)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    if not enabled:
        yield
        return
    with mock.patch.object(hf, "torch_chunk_gated_delta_rule", hf.torch_chunk_gated_delta_rule.__wrapped__):
        yield


@contextlib.contextmanager
def no_tf32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def run_looped(model, sequences, count):
    """transformers' model over each sequence alone: (real-token logits, loss), backward done."""
    loss, logits = 0.0, []
    for seq in sequences:
        out = model(input_ids=seq[None], labels=seq[None], num_items_in_batch=count)
        loss = loss + out.loss
        logits.append(out.logits[0])
    loss.backward()
    return torch.cat(logits).detach(), loss.detach()


def packed_hf_inputs(sequences, count):
    """transformers' packed path: one row, positions restarting per sequence, flash-style lengths."""
    ids = torch.cat(sequences)
    labels = torch.cat([torch.cat([s[1:], s.new_full((1,), -100)]) for s in sequences])
    lengths = torch.tensor([len(s) for s in sequences])
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32).to(ids.device)
    positions = torch.cat([torch.arange(len(s), device=ids.device) for s in sequences])
    return dict(
        input_ids=ids[None], position_ids=positions[None], labels=labels[None], shift_labels=labels[None],
        num_items_in_batch=count, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(lengths.max()),
        max_length_k=int(lengths.max()),
    )  # fmt: skip


def run_packed(step, inputs):
    out = step(**inputs)
    out.loss.backward()
    return out.logits[0].detach(), out.loss.detach()


def real_rows(batch) -> torch.Tensor:
    """Rows of the packed (padded) batch that hold real tokens, in sequence order."""
    cu, cup = batch.cu_seqlens.long().cpu(), batch.cu_seqlens_padded.long().cpu()
    rows = [torch.arange(s, s + n) for s, n in zip(cup[:-1].tolist(), cu.diff().tolist())]
    return torch.cat(rows).to(batch.input_ids.device)


def mixer_gradients(model) -> dict[str, torch.Tensor]:
    """Every mixer's parameter gradients (float32), flattened and concatenated per mixer."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        mixer = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
        name = f"layer {i} {'GDN' if hasattr(layer, 'linear_attn') else 'attention'} grads"
        out[name] = torch.cat([p.grad.float().flatten() for p in mixer.parameters()])
    return out


def errors(logits, loss, grads, ref) -> dict[str, float]:
    ref_logits, ref_loss, ref_grads = ref
    out = {"logits": rel_error(logits, ref_logits), "loss": rel_error(loss, ref_loss)}
    out.update({k: rel_error(grads[k], ref_grads[k]) for k in ref_grads})
    return out


def main() -> None:
    checks_off()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="real tokens in the batch")
    parser.add_argument("--seqs", type=int, default=8, help="sequences in the batch")
    parser.add_argument("--runs", type=int, default=20, help="timed fwd+bwd steps per form")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, few runs")
    add_out_argument(parser)
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS), help="forms to run (default: all)")
    args = parser.parse_args()

    from cp_ops.integrations.transformers import apply_context_parallel, shard_batch

    if args.smoke:
        device, sizes, tokens, seqs, runs, warmup = torch.device("cpu"), SIZES["smoke"], 192, 4, 1, 0
        backend = "aot_eager"  # dynamo and AOT autograd as on the GPU; Inductor's CPU code would only cost time
    else:
        backend = "inductor"
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --smoke for the CPU)")
        device, sizes, tokens, seqs = torch.device("cuda"), SIZES["full"], args.tokens, args.seqs
        runs, warmup = args.runs, 3
    cpu = device.type == "cpu"
    config = make_config(sizes)
    lengths = random_lengths(tokens, seqs, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, config.vocab_size, (n,), generator=gen).to(device) for n in lengths]
    count = sum(n - 1 for n in lengths)
    base = build_model(config).to(device)

    # the float32 reference: transformers' model, one sequence at a time, torch delta rule, no TF32
    start = time.perf_counter()
    with torch_delta_rule(True), no_tf32():
        ref_logits, ref_loss = run_looped(base, sequences, count)
    print(f"float32 reference: {time.perf_counter() - start:.1f} s", flush=True)
    reference = (ref_logits, ref_loss, mixer_gradients(base))

    theirs = build_model(config).to(device, torch.bfloat16)
    ours = apply_context_parallel(build_model(config).to(device, torch.bfloat16))
    batch = shard_batch(sequences, 1, 0)
    ours_inputs, rows = batch.model_inputs(), real_rows(batch)
    compiled = torch.compile(ours, fullgraph=True, backend=backend)
    hf_packed = packed_hf_inputs(sequences, count)

    def ours_step(model):
        def step():
            model.zero_grad(set_to_none=True)
            logits, loss = run_packed(model, ours_inputs)
            return logits[rows], loss

        return step

    def theirs_looped():
        theirs.zero_grad(set_to_none=True)
        with torch_delta_rule(cpu):
            return run_looped(theirs, sequences, count)

    def theirs_packed():
        theirs.zero_grad(set_to_none=True)
        with torch_delta_rule(cpu):
            return run_packed(theirs, hf_packed)

    forms = {
        "ours, compiled": (ours_step(compiled), ours),
        "ours, eager": (ours_step(ours), ours),
        "hf, looped": (theirs_looped, theirs),
        "hf, packed": (theirs_packed, theirs),
    }
    results = {}
    for name, (step, model) in forms.items():
        if name not in args.forms:
            continue
        try:
            start = time.perf_counter()
            logits, loss = step()  # the first step: compiles and autotunes what it needs
            if not cpu:
                torch.cuda.synchronize(device)
            first_s = time.perf_counter() - start
            errs = errors(logits, loss, mixer_gradients(model), reference)
            ms = median_ms_counted(step, warmup=warmup, runs=runs, device=device)
        except Exception as err:  # noqa: BLE001 (a form that fails is reported, the others still run)
            if name.startswith("ours"):
                raise
            results[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
            print(f"{name}: failed, {results[name]['error']}", flush=True)
            continue
        results[name] = {"ms": ms, "tokens_per_s": tokens / ms * 1e3, "first_step_s": first_s, "errors": errs}
        print(f"{name}: {ms:.2f} ms, {tokens / ms * 1e3:,.0f} tokens/s, first step {first_s:.1f} s, "
              f"logits error {errs['logits']:.2e}", flush=True)  # fmt: skip

    checks = {}
    if "errors" in results.get("hf, looped", {}):
        theirs_err = results["hf, looped"]["errors"]
        for form in [f for f in ("ours, compiled", "ours, eager") if "errors" in results.get(f, {})]:
            # the scalar loss agrees to rounding noise in every form: reported, not compared
            ratios = {k: v / max(theirs_err[k], 1e-12) for k, v in results[form]["errors"].items() if k != "loss"}
            ok = all(r <= MAX_ERROR_RATIO for r in ratios.values())
            checks[form] = {"error ratios vs hf, looped": ratios, "ok": ok}

    keys = list(reference[2]) + ["logits", "loss"]
    header = ["form", "ms / step", "tokens/s", "first step s"] + [f"error: {k}" for k in keys]
    formats = [None, "{:.2f}", "{:,.0f}", "{:.1f}"] + ["{:.2e}"] * len(keys)
    table = []
    for name, res in results.items():
        if "error" in res:
            table.append([name, "failed", res["error"][:60], ""] + [""] * len(keys))
            continue
        errs = [res["errors"][k] for k in keys]
        table.append([name, res["ms"], res["tokens_per_s"], res["first_step_s"]] + errs)
    check_rows = [[form, "yes" if c["ok"] else "NO", max(c["error ratios vs hf, looped"].values())]
                  for form, c in checks.items()]  # fmt: skip
    env, name = fla_environment(), "qwen3-next" + "-smoke" * args.smoke
    title = f"Qwen3-Next, 2 layers (GDN + attention), {'smoke sizes' if args.smoke else 'Qwen3-Next widths'}, bf16"
    notes = (f"{tokens} real tokens in {seqs} sequences {lengths}; fwd+bwd of the batch loss; median of {runs} "
             "runs; errors against transformers' model in float32 run one sequence at a time")  # fmt: skip
    emit([
        Result("qwen3_next", title, header, table, notes, env, name=name, formats=formats),
        Result("qwen3_next", f"{title}: the error check", ["form", f"error <= {MAX_ERROR_RATIO}x hf, looped's",
               "largest ratio"], check_rows, "on the logits and the mixers' gradients", env, name=f"{name}-checks",
               formats=[None, None, "{:.2f}"]),
    ], args.out)  # fmt: skip
    if args.smoke and not all(c["ok"] for c in checks.values()):
        raise SystemExit(f"error check failed: {checks}")


if __name__ == "__main__":
    main()
