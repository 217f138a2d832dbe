"""Single-process commands: generate, perplexity, tokenize, inspect."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter

from tqdm import tqdm

from services.process.args import config_from_args, sampling_from_args
from shared.config import LoadConfig
from shared.errors import StagemeshError
from shared.files.layers import parse_split
from shared.models import TransformerModel
from shared.models.crossover import apply_measured_crossover
from shared.models.device import default_device, resolve_dtype
from shared.runtime.generation import GenerationTimings, generate_tokens, perplexity, perplexity_chunks
from shared.runtime.model_files import ModelFiles
from shared.runtime.stage_runtime import LocalPipeline
from shared.text.tokenizer import IncrementalDetokenizer


def _pipeline(files: ModelFiles, args, kv_slots: int = 1) -> LocalPipeline:
    ranges = parse_split(args.split, files.config.num_layers) if getattr(args, "split", None) else None
    load = config_from_args(LoadConfig, args)
    device = default_device()
    return LocalPipeline.load(files.loader, ranges, resolve_dtype(load.dtype, device), device, kv_slots=kv_slots,
                              weights=load.weights_mode, batch_invariant=load.batch_invariant,
                              compile_decode=load.compile_decode, memory_budget=load.memory_budget,
                              kv_dtype=load.kv_dtype)


def cmd_generate(args) -> int:
    files = ModelFiles.open(args.model)
    params = sampling_from_args(args)
    if args.max_tokens < 1:
        raise StagemeshError("--max-tokens must be at least 1")
    tok = files.tokenizer
    if args.chat:
        prompt_ids = files.chat_prompt_ids([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tok.encode(args.prompt)
    pipeline = _pipeline(files, args)
    timings = GenerationTimings()
    detok = IncrementalDetokenizer(tok)
    ids, text = [], []
    for token in generate_tokens(pipeline, prompt_ids, params, args.max_tokens, tok.eos_ids, timings=timings):
        ids.append(token)
        if token in tok.eos_ids:
            break
        delta = detok.push(token)
        text.append(delta)
        if not args.json and delta:
            sys.stdout.write(delta)
            sys.stdout.flush()
    tail = detok.flush()
    text.append(tail)
    if args.json:
        print(json.dumps({"token_ids": ids, "text": "".join(text), "timings": timings.as_dict()}))
    else:
        sys.stdout.write(tail + "\n")
        sys.stdout.flush()
        t = timings.as_dict()
        print(f"[{t['generated_tokens']} tokens, first after {t['time_to_first_token_s']} s, "
              f"{t['decode_tokens_per_s']} tokens/s]", file=sys.stderr)
    return 0


def cmd_perplexity(args) -> int:
    files = ModelFiles.open(args.model)
    try:
        text = open(args.file, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise StagemeshError(f"cannot read --file {args.file}: {e}") from None
    if files.loader.get("tokenizer.ggml.add_eos_token", False):
        # llama-perplexity asserts !llama_vocab_get_add_eos: it gives no figure for such a model to agree with
        raise StagemeshError(f"{args.model}'s vocabulary appends EOS to every text (tokenizer.ggml.add_eos_token), "
                             "which llama.cpp's llama-perplexity refuses; perplexity follows its rule and cannot "
                             "score this model")
    tok = files.tokenizer
    ids = tok.encode(text)  # the whole text once, BOS first if the model asks for it
    bos_id = tok.bos_id if tok.add_bos else None
    n_chunks = len(perplexity_chunks(ids, args.context, bos_id))  # a too-short text fails before the model loads
    pipeline = _pipeline(files, args)
    t0 = time.perf_counter()
    with tqdm(total=n_chunks, desc="perplexity", unit="chunk", disable=not sys.stderr.isatty()) as bar:
        result = perplexity(pipeline, ids, args.context, bos_id, progress=bar.update)
    if args.json:
        print(json.dumps({"perplexity": result.perplexity, "nll_mean": result.nll_mean,
                          "scored_tokens": result.scored_tokens, "chunks": result.chunks}))
    else:
        print(",".join(f"[{i}]{p:.4f}" for i, p in enumerate(result.running, 1)))  # llama-perplexity's running line
        print(f"perplexity {result.perplexity:.4f} (mean NLL {result.nll_mean:.4f} over {result.scored_tokens} tokens "
              f"in {result.chunks} chunks of {args.context}, {time.perf_counter() - t0:.1f} s)")
    return 0


def cmd_tokenize(args) -> int:
    files = ModelFiles.open(args.model)
    ids = files.tokenizer.encode(args.text, parse_special=args.special)
    print(json.dumps({"ids": ids}) if args.json else " ".join(map(str, ids)))
    return 0


def cmd_inspect(args) -> int:
    files = ModelFiles.open(args.model)
    loader, c, tok = files.loader, files.config, files.tokenizer
    types = Counter(loader.tensor_type(n) for n in loader.tensor_names)
    rows = [
        ("file", loader.path), ("name", loader.model_name), ("fingerprint", loader.fingerprint),
        ("architecture", c.architecture), ("layers", c.num_layers), ("hidden", c.hidden_size),
        ("ffn", c.intermediate_size), ("heads / kv heads", f"{c.num_heads} / {c.num_kv_heads} (head_dim {c.head_dim})"),
        ("rope", f"{c.traits.rope_style}, theta {c.rope_theta:g}, dims {c.rope_dim}"),
        ("context", c.context_length), ("vocab", c.vocab_size), ("tied embeddings", c.tied_embeddings),
        ("tensor types", ", ".join(f"{k} x{v}" for k, v in types.most_common())),
        ("tokenizer", f"{loader.get('tokenizer.ggml.model')} (pre {loader.get('tokenizer.ggml.pre', '-')}), "
                      f"bos {tok.bos_id}, eos {tok.eos_id}, add_bos {tok.add_bos}"),
        ("chat template", files.chat_template_origin + (
            f": {files.chat_template_source[:160]}".replace("\n", "\\n") if files.chat_template_source else "")),
    ]
    model = TransformerModel.from_gguf(loader, None, resolve_dtype(None, default_device()), default_device(), weights="auto")
    apply_measured_crossover(model)
    summary = model.weight_summary()
    runs_as = Counter(summary.values())
    rows.append((f"runs as ({model.weights})", "; ".join(f"{k} x{v}" for k, v in runs_as.most_common())))
    mem = model.memory_report()
    rows.append(("weights in memory", f"{mem['weight_bytes'] / 2**20:.1f} MiB = {mem['weights_per_file_byte']}x the "
                                      f"file's {mem['file_bytes'] / 2**20:.1f} MiB (embedding read from the file: "
                                      f"{mem['mapped_bytes'] / 2**20:.1f} MiB); {mem['prefill_copy']}"))
    rows += _per_layer_rows(loader, summary, c.num_layers)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _per_layer_rows(loader, summary: dict[str, str], num_layers: int) -> list[tuple[str, str]]:
    """One row per run of consecutive layers whose matrices have the same GGUF types and kernels, e.g.
    ("layers 0-29", "attn_q Q4_1 -> q4_1-dot-q8 ... (fused qkv); ..."), then the embedding and the head."""

    def describe(layer: int) -> str:
        prefix = f"blk.{layer}."
        return "; ".join(f"{n.removeprefix(prefix).removesuffix('.weight')} {loader.tensor_type(n)} -> {kind}"
                         for n, kind in summary.items() if n.startswith(prefix))

    rows: list[tuple[str, str]] = []
    start = 0
    for i in range(1, num_layers + 1):
        if i == num_layers or describe(i) != describe(start):
            rows.append((f"layer {start}" if i - 1 == start else f"layers {start}-{i - 1}", describe(start)))
            start = i
    for name in ("token_embd.weight", "output.weight"):
        if name in summary:
            rows.append((name.removesuffix(".weight"), f"{loader.tensor_type(name)} -> {summary[name]}"))
    return rows
