"""Retrieval, batched in process vs Search-R1's server design, on the same corpus, index and encoder.

    python -m bench.bench_retrieval                # toy world + synthetic 1M x 768; Q = 1, 16, 512
    python -m bench.bench_retrieval --worlds synthetic --passages 20000 --dim 384 --reps 3   # a quick look
    pytest --benchmark-only bench/bench_retrieval.py         # (make bench) in-process search on the host, small

Every path goes from query strings to the token ids of Search-R1's observations
(``\\n\\n<information>Doc 1(Title: …) …</information>\\n\\n``) for the policy tokenizer:

* ``searchr1_http``: a re-implementation of Search-R1's ``retrieval_server.py`` (FastAPI +
  uvicorn in its own process; encode, ``.cpu().numpy()``, FAISS search, documents looked up
  row by row in Python) called the way ``generation.py`` calls it (``requests.post`` per
  batch, ``_passages2string``, the ``<information>`` wrapping, then tokenizing the strings).
  NOTE: Search-R1 holds the corpus as a ``datasets`` table; here it is a Python list of
  dicts (``datasets`` is not installed), which makes its row lookups faster, not slower.
* ``fastcredit_http``: ``python -m fastcredit.retrieval.serve`` called with the same client code.
* ``fastcredit_inprocess``: ``Retriever.observation_tokens`` — one encoder call, one index
  search, one gather from the pre-tokenized token store; no HTTP, no text.
* ``encode_only``: the query encoder alone, the floor under every path.

Two worlds, each with every path:

* ``toy``: the toy world's corpus (2,824 passages), embedded with the real MiniLM by
  ``fastcredit.retrieval.build``; queries are its questions.
* ``synthetic``: ``--passages`` (1M) 60-word passages and a flat index of random unit
  vectors of ``--dim`` (768) dimensions, with a BERT-base-sized encoder (e5-base-v2's
  shape, random weights) on both sides: search cost does not depend on the values, and
  embedding 1M passages would take hours on 2 cores.

Medians of ``--reps`` runs after one warm-up; paths run one after the other on the same
machine. Results go to ``bench/results/retrieval_<device>.json``. On a GPU the in-process
path also runs on CUDA.

Under pytest-benchmark (every machine, on the host, no servers): ``test_retrieval_search_cpu`` times a flat
inner-product search over ``CPU_INDEX`` random unit vectors, fastcredit's matmul index (``torch_flat``) against
FAISS's (``faiss_flat``, Search-R1's); ``test_retrieval_observations_cpu`` the whole in-process path, query strings
to observation token ids (``Retriever.observation_tokens``), over 2,000 passages with a tiny random encoder.
"""
# NOTE: no `from __future__ import annotations`: FastAPI must see the request model class
# itself, not a string it cannot resolve inside searchr1_server.
import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import List, Optional

import numpy as np
import pytest
import torch

from bench.results_io import child_env, device_name, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CPU_INDEX = {"passages": 20_000, "dim": 384}  # make bench: MiniLM's width
CPU_QUERIES, CPU_K = (1, 16, 256), 3


def searchr1_server(corpus_path: str, index_path: str, model_path: str, port: int, device: str) -> None:
    """Search-R1's ``retrieval_server.py`` (dense retriever, FastAPI endpoint), same steps in the same order."""
    import faiss
    import uvicorn
    from fastapi import FastAPI
    from pydantic import BaseModel
    from tqdm import tqdm
    from transformers import AutoModel, AutoTokenizer

    faiss.cvar.distance_compute_blas_threshold = 20  # the same FAISS setting on both sides
    with open(corpus_path) as f:
        corpus = [json.loads(line) for line in f]
    index = faiss.read_index(index_path)
    model = AutoModel.from_pretrained(model_path).eval().to(device)
    if device == "cuda":
        model = model.half()  # Search-R1's server main sets retrieval_use_fp16=True
    tokenizer = AutoTokenizer.from_pretrained(model_path, use_fast=True)

    @torch.no_grad()
    def encode(query_list: List[str]) -> np.ndarray:
        inputs = tokenizer(query_list, max_length=256, padding=True, truncation=True, return_tensors="pt")
        inputs = {k: v.to(device) for k, v in inputs.items()}
        output = model(**inputs, return_dict=True)
        mask = inputs["attention_mask"]
        last_hidden = output.last_hidden_state.masked_fill(~mask[..., None].bool(), 0.0)
        emb = torch.nn.functional.normalize(last_hidden.sum(dim=1) / mask.sum(dim=1)[..., None], dim=-1)
        emb = emb.detach().cpu().numpy().astype(np.float32, order="C")
        del inputs, output
        torch.cuda.empty_cache()
        return emb

    def batch_search(query_list: List[str], num: int):
        results, scores = [], []
        for start in tqdm(range(0, len(query_list), 512), desc="Retrieval process: "):
            batch = query_list[start:start + 512]
            batch_scores, batch_idxs = index.search(encode(batch), k=num)
            batch_scores, batch_idxs = batch_scores.tolist(), batch_idxs.tolist()
            flat = sum(batch_idxs, [])
            docs = [corpus[int(i)] for i in flat]
            results.extend([docs[i * num:(i + 1) * num] for i in range(len(batch_idxs))])
            scores.extend(batch_scores)
        return results, scores

    class QueryRequest(BaseModel):
        queries: List[str]
        topk: Optional[int] = None
        return_scores: bool = False

    app = FastAPI()

    @app.post("/retrieve")
    def retrieve_endpoint(request: QueryRequest):
        results, scores = batch_search(request.queries, request.topk or 3)
        resp = []
        for i, single in enumerate(results):
            resp.append([{"document": d, "score": s} for d, s in zip(single, scores[i])]
                        if request.return_scores else single)
        return {"result": resp}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def searchr1_client(url: str, queries: List[str], topk: int, tokenizer) -> torch.Tensor:
    """generation.py: ``_batch_search`` → ``_passages2string`` → wrapping → ``_process_next_obs``'s tokenizer call."""
    import requests

    answer = requests.post(url, json={"queries": queries, "topk": topk, "return_scores": True})
    if answer.status_code != 200:
        raise RuntimeError(f"{url} answered {answer.status_code}: {answer.text[:300]}")
    results = answer.json()["result"]
    strings = []
    for result in results:
        ref = ""
        for idx, doc_item in enumerate(result):
            content = doc_item["document"]["contents"]
            ref += f"Doc {idx + 1}(Title: {content.split(chr(10))[0]}) {chr(10).join(content.split(chr(10))[1:])}\n"
        strings.append(f"\n\n<information>{ref.strip()}</information>\n\n")
    return tokenizer(strings, padding="longest", return_tensors="pt", add_special_tokens=False)["input_ids"]


def make_toy(folder: str) -> dict:
    """The toy world's corpus, indexed with the real MiniLM (fastcredit's build); queries: its questions."""
    from fastcredit.data.toyworld import generate_world, write_world
    from fastcredit.retrieval.build import build_all

    world = generate_world()
    write_world(world, os.path.join(folder, "toy"))
    corpus = os.path.join(folder, "toy", "corpus.jsonl")
    out = build_all(corpus, os.path.join(folder, "toy_index"), encoder="minilm", progress=False)
    with open(os.path.join(out, "build.json")) as f:
        index = os.path.join(out, json.load(f)["index"])
    with open(corpus) as f:
        sample = [json.loads(line)["contents"].replace("\n", " ") for _, line in zip(range(2000), f)]
    queries = [q.question for q in world.questions]
    return {"corpus": corpus, "index": index, "encoder": "minilm", "sample": sample, "queries": queries,
            "passages": sum(1 for _ in open(corpus)), "dim": 384,
            "encoder_desc": "all-MiniLM-L6-v2 (real weights)", "embeddings": "MiniLM embeddings of the passages"}


def bert_base_encoder(folder: str, seed: int) -> str:
    """A BERT-base-sized encoder (768 hidden, 12 layers: e5-base-v2's shape) with random weights and MiniLM's
    tokenizer, saved as a local folder; it costs what Search-R1's E5 query encoder costs."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    from fastcredit.retrieval.encoders import encoder_path

    path = os.path.join(folder, "bert-base-random")
    tokenizer = AutoTokenizer.from_pretrained(encoder_path("minilm"), local_files_only=True, use_fast=True)
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=len(tokenizer)), add_pooling_layer=False).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_synthetic(folder: str, n: int, dim: int, seed: int) -> dict:
    """A synthetic corpus jsonl and a Search-R1-style flat IP index of random unit vectors ([n, dim])."""
    import faiss

    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    vocab = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "vu", "ze")
             for b in ("ban", "cor", "dil", "fen", "gar", "hol", "jun", "kel", "lim", "mor")]
    corpus_path = os.path.join(folder, "corpus.jsonl")
    sample = []
    with open(corpus_path, "w") as f:
        for i in range(n):
            title = " ".join(rng.choice(vocab).title() for _ in range(2))
            text = " ".join(rng.choice(vocab) for _ in range(60)) + "."
            f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{text}'}) + "\n")
            if i < 2000:
                sample.append(f"Doc 1(Title: \"{title}\") {text}")
    index = faiss.index_factory(dim, "Flat", faiss.METRIC_INNER_PRODUCT)
    gen = np.random.default_rng(seed)
    for lo in range(0, n, 1 << 17):  # in slices: never a second [n, dim] copy in memory
        x = gen.standard_normal((min(n, lo + (1 << 17)) - lo, dim)).astype(np.float32)
        index.add(x / np.linalg.norm(x, axis=1, keepdims=True))
    index_path = os.path.join(folder, "e5_Flat.index")
    faiss.write_index(index, index_path)
    del index
    encoder = bert_base_encoder(folder, seed) if dim == 768 else "minilm"
    return {"corpus": corpus_path, "index": index_path, "encoder": encoder, "sample": sample, "queries": None,
            "passages": n, "dim": dim,
            "encoder_desc": ("BERT-base-sized (e5-base-v2's shape), random weights" if dim == 768
                             else "all-MiniLM-L6-v2"),
            "embeddings": "random unit vectors (search cost does not depend on the values)"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list, url: str, log_path: str, timeout_s: float = 300.0) -> subprocess.Popen:
    env = child_env(ROOT, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log_path, "w"), env=env)
    body = json.dumps({"queries": ["warm up"], "topk": 1}).encode()
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not answer within {timeout_s} s; see {log_path}")


def median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_world(name: str, w: dict, args, device: str, folder: str) -> dict:
    """All paths on one corpus / index / encoder, batch by batch; returns the world's report."""
    from fastcredit.retrieval.retriever import open_retriever
    from fastcredit.retrieval.testing import tiny_policy_tokenizer

    t0 = time.time()
    policy_tok = tiny_policy_tokenizer([(str(i), "", s) for i, s in enumerate(w["sample"])], vocab_size=2000)
    retriever = open_retriever(corpus=w["corpus"], index=w["index"], encoder=w["encoder"], tokenizer=policy_tok,
                               device=device, progress=True)
    setup_s = time.time() - t0
    print(f"[{name}] {w['passages']:,} passages x {w['dim']}: stores and tokenizer ready in {setup_s:.0f} s",
          flush=True)
    rng = random.Random(args.seed + 1)
    if w["queries"]:
        queries = [rng.choice(w["queries"]) for _ in range(max(args.batches))]
    else:
        words = w["sample"][0].split()[5:]
        queries = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 12))) for _ in range(max(args.batches))]
    ports = {n: free_port() for n in ("searchr1_http", "fastcredit_http")}
    urls = {n: f"http://127.0.0.1:{port}/retrieve" for n, port in ports.items()}
    encoder_folder = w["encoder"] if os.path.isdir(w["encoder"]) else __import__(
        "fastcredit.retrieval.encoders", fromlist=["encoder_path"]).encoder_path(w["encoder"])
    cmds = {
        "searchr1_http": [sys.executable, "-m", "bench.bench_retrieval", "--serve-searchr1", w["corpus"], w["index"],
                          encoder_folder, str(ports["searchr1_http"]), device],
        "fastcredit_http": [sys.executable, "-m", "fastcredit.retrieval.serve", "--corpus", w["corpus"], "--index",
                            w["index"], "--encoder", w["encoder"], "--device", device, "--port",
                            str(ports["fastcredit_http"]), "--max-queries", "4096",
                            "--timeout-s", "900"],  # a 512-query batch through BERT-base takes ~40 s on 2 cores
    }
    rows, procs = [], {}
    try:
        for n, cmd in cmds.items():
            procs[n] = start_server(cmd, urls[n], os.path.join(folder, f"{name}_{n}.log"))
        agree = same_results(urls["searchr1_http"], retriever, queries[:64], args.k)
        for q in args.batches:
            batch = queries[:q]
            row = {"queries": q, "k": args.k}
            row["encode_only_ms"] = 1e3 * median_s(lambda: retriever.encoder.encode_queries(batch), args.reps)
            for n, url in urls.items():
                row[f"{n}_ms"] = 1e3 * median_s(lambda: searchr1_client(url, batch, args.k, policy_tok), args.reps)
            row["fastcredit_inprocess_ms"] = 1e3 * median_s(lambda: retriever.observation_tokens(batch, args.k),
                                                            args.reps)
            row["speedup_inprocess_vs_searchr1"] = row["searchr1_http_ms"] / row["fastcredit_inprocess_ms"]
            row["speedup_http_vs_searchr1"] = row["searchr1_http_ms"] / row["fastcredit_http_ms"]
            enc = row["encode_only_ms"]
            over = {n: row[f"{n}_ms"] - enc for n in ("searchr1_http", "fastcredit_http", "fastcredit_inprocess")}
            row["overhead_beyond_encoder_ms"] = over
            # The encoder is the same model on every path; what the designs differ in is everything else.
            row["overhead_ratio_searchr1_vs_inprocess"] = (
                over["searchr1_http"] / max(over["fastcredit_inprocess"], 1.0))  # ms; below 1 ms is timer noise
            rows.append(row)
            print(f"[{name}] Q={q:4d}  encode {enc:8.1f} ms | searchr1 {row['searchr1_http_ms']:8.1f} | "
                  f"fastcredit http {row['fastcredit_http_ms']:8.1f} | "
                  f"in-process {row['fastcredit_inprocess_ms']:8.1f} | "
                  f"x{row['speedup_inprocess_vs_searchr1']:.2f} in-process, "
                  f"x{row['speedup_http_vs_searchr1']:.2f} http; "
                  f"beyond the encoder x{row['overhead_ratio_searchr1_vs_inprocess']:.1f}", flush=True)
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(30)
    return {"passages": w["passages"], "dim": w["dim"], "encoder": w["encoder_desc"], "embeddings": w["embeddings"],
            "index": f"FAISS IndexFlatIP, {w['dim']} dims (Search-R1's e5_Flat.index layout)",
            "top_ids_agree_with_searchr1": agree, "setup_s": setup_s, "results": rows}


def run(args) -> dict:
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else (
        "cpu" if args.device == "auto" else args.device)
    folder = tempfile.mkdtemp(prefix="bench_retrieval_")
    worlds = {}
    for name in args.worlds:
        t0 = time.time()
        w = make_toy(folder) if name == "toy" else make_synthetic(os.path.join(folder, name), args.passages, args.dim,
                                                                  args.seed)
        print(f"[{name}] corpus and index made in {time.time() - t0:.0f} s", flush=True)
        worlds[name] = measure_world(name, w, args, device, folder)
    return {"device": device_name(device), "device_type": device, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "load_average_1min": os.getloadavg()[0], "reps": args.reps,
            "worlds": worlds, "gpu": "measured" if device == "cuda" else "skipped: no CUDA device on this machine"}


def same_results(url: str, retriever, queries: list, k: int) -> float:
    """Share of queries whose top-k ids are identical on both sides (near-ties may swap)."""
    import requests

    theirs = requests.post(url, json={"queries": queries, "topk": k, "return_scores": True}).json()["result"]
    ours = retriever.search(queries, k)
    return float(np.mean([[d["document"]["id"] for d in t] == [h.id for h in o] for t, o in zip(theirs, ours)]))


@pytest.fixture(scope="module")
def cpu_vectors() -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((CPU_INDEX["passages"], CPU_INDEX["dim"]), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("queries", CPU_QUERIES)
@pytest.mark.parametrize("provider", ("torch_flat", "faiss_flat"))
def test_retrieval_search_cpu(benchmark, cpu_vectors, provider, queries):
    """Top-k of ``queries`` query vectors (passages' own vectors, perturbed) over the flat index."""
    from fastcredit.retrieval.indexes import FaissIndex, TorchFlatIndex, build_faiss_index

    index = TorchFlatIndex(cpu_vectors) if provider == "torch_flat" else \
        FaissIndex(build_faiss_index([cpu_vectors], "flat", progress=False))
    q = torch.from_numpy(cpu_vectors[:queries]) + 0.1 * torch.randn(queries, CPU_INDEX["dim"])
    benchmark.extra_info.update(device=device_name(), k=CPU_K, **CPU_INDEX)
    scores, rows = benchmark(index.search, q, CPU_K)
    assert rows.shape == (queries, CPU_K)


@pytest.fixture(scope="module")
def cpu_retriever(tmp_path_factory):
    """2,000 tiny passages, a tiny random encoder (saved as a folder), its flat index and token store."""
    from fastcredit.retrieval.build import build_all
    from fastcredit.retrieval.retriever import open_retriever
    from fastcredit.retrieval.testing import tiny_encoder, tiny_passages, tiny_policy_tokenizer, write_corpus

    d = tmp_path_factory.mktemp("retrieval")
    passages = tiny_passages(2000, seed=0)
    corpus = write_corpus(str(d / "corpus.jsonl"), passages)
    enc = tiny_encoder(dim=64, seed=0)
    enc.model.save_pretrained(str(d / "encoder"))
    enc.tokenizer.save_pretrained(str(d / "encoder"))
    build = build_all(corpus, str(d / "build"), encoder_obj=enc, progress=False)
    return open_retriever(index=build, encoder=str(d / "encoder"), tokenizer=tiny_policy_tokenizer(passages),
                          device="cpu", progress=False), passages


@pytest.mark.parametrize("queries", CPU_QUERIES[1:])
def test_retrieval_observations_cpu(benchmark, cpu_retriever, queries):
    """Query strings to packed observation token ids, in process: encode, search, gather the token store."""
    retriever, passages = cpu_retriever
    rng = random.Random(queries)
    batch = [" ".join(rng.choice(passages)[2].split()[:rng.randint(3, 8)]) for _ in range(queries)]
    benchmark.extra_info.update(device=device_name(), k=CPU_K, passages=len(passages))
    ids, cu = benchmark(retriever.observation_tokens, batch, CPU_K)
    assert cu.numel() == queries + 1


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-searchr1":
        corpus, index, model, port, device = sys.argv[2:7]
        searchr1_server(corpus, index, model, int(port), device)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=lambda s: s.split(","), default=["toy", "synthetic"],
                   help="comma-separated: toy (the toy world, real MiniLM), synthetic (--passages x --dim)")
    p.add_argument("--passages", type=int, default=1_000_000, help="synthetic corpus size")
    p.add_argument("--dim", type=int, default=768, help="synthetic index dimension (768: a BERT-base-sized encoder)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 512])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = run(args)
    write_results("retrieval", report, args.out)


if __name__ == "__main__":
    main()
