"""`trainbench prepare bert`: raw text -> training-ready MLPerf BERT shards, in two streaming passes.

Pass 1 (map). The parent reads the input and cuts it into chunks of whole documents (see
:mod:`trainbench.data.text`). A worker turns each chunk into sentences, WordPiece ids and masked
instances (:mod:`trainbench.data.pretraining`), holds out documents for the eval set, deals the training
instances out to the output shards, and saves the result under ``OUT/.work/chunks/`` (written to a
temporary folder, renamed when complete).

Pass 2 (reduce). A worker gathers each output shard's instances from every chunk (memory-mapped, in chunk
order), shuffles them, and writes the shard in each requested format (written to a temporary name,
renamed when complete); a small record of the shard's md5s and statistics is written last, and its
presence is what marks the shard done. The eval set is gathered the same way.

Every random draw is seeded by (seed, chunk) or (seed, shard), and chunk boundaries depend only on the
input, so the output is byte-identical for any ``--workers``. ``--resume`` reuses finished chunks and
shards after an interruption; the recipe (all settings and the inputs' sizes and mtimes) must match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainbench.data import text as textmod
from trainbench.data.bert_hdf5 import fixed_arrays, shard_record, write_arrays, write_shard, write_varlength
from trainbench.data.packing import PACKED_DTYPES, pack, packed_predictions
from trainbench.data.pretraining import Instances, InstanceSpec, concat, create_instances, permute
from trainbench.data.wordpiece import FastWordPiece, read_vocab, train_vocab
from trainbench.errors import DataError, UserError

ALL_FORMATS = ("fixed", "varlength", "bins", "packed")
BINS = (128, 256, 384, 512)  # the 4-bin split by sequence length
_TABLE = ("offset", "len_a", "nsp", "mask_offset")  # columns of a chunk's per-instance table
# Peak memory of one worker per MB of chunk text, plus its fixed cost (measured at --chunk-mb 4 and 16 on two
# corpora: docs/notes/data-preparation.md, "BERT data preparation").
_WORKER_MB_PER_CHUNK_MB = 55
_WORKER_BASE_MB = 200


@dataclass
class PrepareSpec:
    """Everything that decides the output's bytes (recorded in manifest.json)."""

    inputs: list[str]
    input_format: str
    vocab_md5: str
    seed: int = 12345
    max_seq_length: int = 512
    max_predictions: int = 76
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 10
    num_shards: int = 4320
    eval_samples: int = 10000
    eval_fraction: float = 0.01
    chunk_mb: float = 4.0
    formats: list[str] = field(default_factory=lambda: ["fixed", "varlength"])
    max_per_pack: int = 3

    @property
    def instance_spec(self) -> InstanceSpec:
        return InstanceSpec(
            self.max_seq_length, self.max_predictions, self.masked_lm_prob, self.short_seq_prob, self.dupe_factor
        )

    def validate(self) -> None:
        checks = [
            (self.max_seq_length >= 8, "--max-seq-length must be at least 8"),
            (self.max_predictions >= 1, "--max-predictions must be at least 1"),
            (0 < self.masked_lm_prob < 1, "--masked-lm-prob must be in (0, 1)"),
            (0 <= self.short_seq_prob <= 1, "--short-seq-prob must be in [0, 1]"),
            (self.dupe_factor >= 1, "--dupe-factor must be at least 1"),
            (self.num_shards >= 1, "--num-shards must be at least 1"),
            (self.eval_samples >= 0, "--eval-samples must not be negative"),
            (0 <= self.eval_fraction < 1, "--eval-fraction must be in [0, 1)"),
            (self.chunk_mb > 0, "--chunk-mb must be positive"),
            (self.max_per_pack >= 1, "--max-per-pack must be at least 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        unknown = [f for f in self.formats if f not in ALL_FORMATS]
        if unknown or not self.formats:
            raise UserError(
                f"--formats: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(ALL_FORMATS)}"
            )
        if "bins" in self.formats and self.max_seq_length not in BINS:
            raise UserError(f"--formats bins needs --max-seq-length in {BINS}")


def md5sum(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def shard_name(i: int, n: int) -> str:
    return f"part_{i:05d}_of_{n:05d}.hdf5"


# -- pass 1: chunks -------------------------------------------------------------------------------------

_tokenizer: FastWordPiece | None = None


def _worker_init(vocab_path: str) -> None:
    global _tokenizer
    _tokenizer = FastWordPiece(vocab_path)


def _special_ids(tok: FastWordPiece) -> dict[str, int]:
    return {t: tok.ids[t] for t in ("[CLS]", "[SEP]", "[MASK]")}


def process_chunk(chunk: textmod.Chunk, spec: PrepareSpec, work: str) -> dict:
    """Chunk -> instances saved under work/chunks/c_<index>; returns the chunk's counts."""
    tok = _tokenizer
    assert tok is not None, "worker not initialised"
    documents = [[tok.encode(s) for s in textmod.document_sentences(chunk.kind, raw)] for raw in chunk.documents]
    n_sent = sum(len(d) for d in documents)
    n_tok = sum(len(s) for d in documents for s in d)
    held_out = np.random.default_rng([spec.seed, chunk.index, 1]).random(len(documents)) < spec.eval_fraction
    parts = []
    for tag, docs, dupes in (
        (0, [d for d, h in zip(documents, held_out, strict=True) if not h], spec.dupe_factor),
        (1, [d for d, h in zip(documents, held_out, strict=True) if h], 1),
    ):
        py_rng = random.Random(f"{spec.seed}:{chunk.index}:{tag}")
        np_rng = np.random.default_rng([spec.seed, chunk.index, 2, tag])
        made = create_instances(
            docs, spec.instance_spec, len(tok.vocab), _special_ids(tok), py_rng, np_rng, dupes, shuffle=False
        )
        parts.append((made, np_rng.permutation(len(made))))
    (train, train_order), (held, _) = parts
    # Shuffle the training instances and deal them out round-robin from a random shard on; store them
    # grouped by shard (one gather does both). The eval instances go last, as shard S.
    start = int(np.random.default_rng([spec.seed, chunk.index, 3]).integers(spec.num_shards))
    dealt = (start + np.arange(len(train))) % spec.num_shards
    by_shard = np.argsort(dealt, kind="stable")
    both = concat([permute(train, train_order[by_shard]), held])
    shard_of_row = np.concatenate([dealt[by_shard], np.full(len(held), spec.num_shards, np.int64)])
    shard_starts = np.searchsorted(shard_of_row, np.arange(spec.num_shards + 2))
    _save_chunk(Path(work) / "chunks" / f"c_{chunk.index:06d}", both, shard_starts, len(tok.vocab))
    return {
        "index": chunk.index,
        "bytes": chunk.nbytes,
        "input_bytes": chunk.input_bytes,
        "documents": len(documents),
        "eval_documents": int(held_out.sum()),
        "sentences": n_sent,
        "tokens": n_tok,
        "train_instances": len(train),
        "eval_instances": len(held),
    }


def _save_chunk(folder: Path, inst: Instances, shard_starts: np.ndarray, vocab_size: int) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    id_type = np.uint16 if vocab_size <= 65536 else np.int32
    table = np.stack([inst.offsets[:-1], inst.len_a, inst.nsp, inst.mask_offsets[:-1]], 1).astype(np.int64)
    np.save(tmp / "table.npy", table)
    np.save(tmp / "tokens.npy", inst.tokens.astype(id_type))
    np.save(tmp / "mask_pos.npy", inst.mask_pos.astype(np.uint16))
    np.save(tmp / "mask_ids.npy", inst.mask_ids.astype(id_type))
    np.save(tmp / "shards.npy", shard_starts.astype(np.int64))
    np.save(tmp / "ends.npy", np.array([inst.offsets[-1], inst.mask_offsets[-1]], np.int64))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def _load_rows(folder: Path, lo: int, hi: int) -> Instances:
    """Instances [lo, hi) of a saved chunk (memory-mapped: only those rows are read)."""
    table = np.load(folder / "table.npy", mmap_mode="r")
    ends = np.load(folder / "ends.npy")
    if hi <= lo:
        return Instances(
            np.empty(0, np.int32), np.zeros(1, np.int64), *(np.empty(0, np.int64),) * 4, np.zeros(1, np.int64)
        )
    rows = np.asarray(table[lo : hi + 1] if hi < len(table) else table[lo:hi])
    tok_end = int(rows[hi - lo, 0]) if hi < len(table) else int(ends[0])
    mask_end = int(rows[hi - lo, 3]) if hi < len(table) else int(ends[1])
    rows = rows[: hi - lo]
    tok_lo, mask_lo = int(rows[0, 0]), int(rows[0, 3])
    tokens = np.load(folder / "tokens.npy", mmap_mode="r")[tok_lo:tok_end].astype(np.int32)
    mpos = np.load(folder / "mask_pos.npy", mmap_mode="r")[mask_lo:mask_end].astype(np.int64)
    mids = np.load(folder / "mask_ids.npy", mmap_mode="r")[mask_lo:mask_end].astype(np.int64)
    return Instances(
        tokens=tokens,
        offsets=np.append(rows[:, 0], tok_end) - tok_lo,
        len_a=rows[:, 1].copy(),
        nsp=rows[:, 2].copy(),
        mask_pos=mpos,
        mask_ids=mids,
        mask_offsets=np.append(rows[:, 3], mask_end) - mask_lo,
    )


def _gather(work: Path, n_chunks: int, shard: int) -> Instances:
    parts = []
    for c in range(n_chunks):
        folder = work / "chunks" / f"c_{c:06d}"
        starts = np.load(folder / "shards.npy")
        parts.append(_load_rows(folder, int(starts[shard]), int(starts[shard + 1])))
    return concat(parts)


# -- pass 2: shards --------------------------------------------------------------------------------------


def length_histogram(inst: Instances, seq_length: int) -> list[int]:
    return np.bincount(inst.lengths, minlength=seq_length + 1).tolist()


def _write_formats(inst: Instances, spec: PrepareSpec, out: Path, kind: str, shard: int, vocab_size: int) -> dict:
    """Write one shard (kind 'train' or 'eval') in every requested format; returns {relative path: info}."""
    files: dict[str, dict] = {}
    if kind == "train":
        name = shard_name(shard, spec.num_shards)
    else:
        name = "eval_10k.hdf5" if len(inst) == 10000 else f"eval_{len(inst)}.hdf5"
    seq, pred = spec.max_seq_length, spec.max_predictions

    def record(path: Path, samples: int, arrays: dict) -> None:
        """The file's md5 and samples, and its record (rows, bytes, each dataset's smallest and largest value),
        which a run checks the file against before it starts."""
        rows = len(arrays["input_ids"])
        files[str(path.relative_to(out))] = {"md5": md5sum(path), "samples": samples} | shard_record(path, rows, arrays)

    if "fixed" in spec.formats or kind == "eval":
        path = out / kind / name
        write_shard(path, arrays := fixed_arrays(inst, seq, pred))
        record(path, len(inst), arrays)
    if "varlength" in spec.formats:
        path = out / f"{kind}_varlength" / name
        record(path, len(inst), write_varlength(path, inst, vocab_size))
    if kind == "train" and "bins" in spec.formats:
        lengths = inst.lengths
        lower = 0
        for upper in (b for b in BINS if b <= seq):
            rows = np.nonzero((lengths > lower) & (lengths <= upper))[0]
            path = out / "train_bins" / f"len_{upper}" / name
            write_shard(path, arrays := fixed_arrays(permute(inst, rows), upper, pred))
            record(path, len(rows), arrays)
            lower = upper
    if kind == "train" and "packed" in spec.formats:
        path = out / "train_packed" / name
        rng = np.random.default_rng([spec.seed, shard, 5])
        columns = packed_predictions(seq, pred, spec.masked_lm_prob, spec.max_per_pack)
        arrays = pack(inst, seq, spec.max_per_pack, columns, rng)
        write_arrays(path, arrays, PACKED_DTYPES)
        record(path, int((arrays["next_sentence_labels"] >= 0).sum()), arrays)
    return files


def write_shards(
    shards: list[int], spec: PrepareSpec, work: str, out: str, n_chunks: int, vocab_size: int
) -> list[dict]:
    """Pass-2 task: gather, shuffle and write the given training shards; one record per shard."""
    work_p, out_p = Path(work), Path(out)
    records = []
    for shard in shards:
        inst = _gather(work_p, n_chunks, shard)
        inst = permute(inst, np.random.default_rng([spec.seed, shard, 4]).permutation(len(inst)))
        files = _write_formats(inst, spec, out_p, "train", shard, vocab_size)
        rec = {
            "shard": shard,
            "samples": len(inst),
            "files": files,
            "length_histogram": length_histogram(inst, spec.max_seq_length),
            "masked": int(inst.mask_offsets[-1]),
            "random_next": int(inst.nsp.sum()),
        }
        done = work_p / "shards" / f"{shard:05d}.json"
        done.with_suffix(".tmp").write_text(json.dumps(rec))
        os.replace(done.with_suffix(".tmp"), done)
        records.append(rec)
    return records


def write_eval(spec: PrepareSpec, work: str, out: str, n_chunks: int, vocab_size: int) -> dict:
    inst = _gather(Path(work), n_chunks, spec.num_shards)
    order = np.random.default_rng([spec.seed, 6]).permutation(len(inst))[: spec.eval_samples]
    inst = permute(inst, order)
    files = _write_formats(inst, spec, Path(out), "eval", spec.num_shards, vocab_size)
    return {
        "samples": len(inst),
        "available": len(order),
        "files": files,
        "length_histogram": length_histogram(inst, spec.max_seq_length),
    }


# -- driver ----------------------------------------------------------------------------------------------


@dataclass
class Options:
    """How to run (does not change the output's bytes)."""

    workers: int = 0  # 0: all cores
    max_memory_gb: float | None = None
    resume: bool = False
    force: bool = False
    keep_work: bool = False
    progress: bool = True


def _recipe_files(files: list[Path]) -> list[dict]:
    return [{"path": str(p), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in files]


def _recipe(spec: PrepareSpec, files: list[Path]) -> dict:
    return {"spec": dataclasses.asdict(spec), "files": _recipe_files(files)}


def _plan_workers(opts: Options, spec: PrepareSpec) -> int:
    cores = os.cpu_count() or 1
    workers = opts.workers or cores
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {opts.workers}")
    per_worker_mb = _WORKER_BASE_MB + _WORKER_MB_PER_CHUNK_MB * spec.chunk_mb
    if opts.max_memory_gb is not None:
        fit = int(opts.max_memory_gb * 1024 // per_worker_mb)
        if fit < 1:
            raise UserError(
                f"--max-memory-gb {opts.max_memory_gb} is below one worker's need (about {per_worker_mb / 1024:.1f} GB "
                f"at --chunk-mb {spec.chunk_mb}); raise it or lower --chunk-mb"
            )
        workers = min(workers, fit)
    return workers


def _prepare_out(out: Path, recipe: dict, opts: Options) -> Path:
    work = out / ".work"
    manifest = out / "manifest.json"
    if manifest.exists():
        old = json.loads(manifest.read_text()).get("recipe")
        if old == recipe and not opts.force:
            return work  # complete already; the caller sees the manifest
        if not opts.force:
            raise UserError(
                f"{out} already holds a prepared data set made differently; choose another --out or add --force"
            )
    if opts.force and out.exists():
        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    elif work.exists():
        if not opts.resume:
            raise UserError(
                f"{out} holds an unfinished preparation; add --resume to continue it or --force to start over"
            )
        old = json.loads((work / "recipe.json").read_text()) if (work / "recipe.json").exists() else None
        if old != recipe:
            changed = _first_difference(old or {}, recipe)
            raise UserError(
                f"--resume: the unfinished preparation in {out} was made with other settings ({changed}); use --force"
            )
    elif out.exists() and any(out.iterdir()):
        raise UserError(f"{out} is not empty; choose an empty or new --out, or add --force to replace what is there")
    (work / "chunks").mkdir(parents=True, exist_ok=True)
    (work / "shards").mkdir(parents=True, exist_ok=True)
    (work / "recipe.json").write_text(json.dumps(recipe, indent=1))
    return work


def _first_difference(old: dict, new: dict) -> str:
    for key in new.get("spec", {}):
        if old.get("spec", {}).get(key) != new["spec"][key]:
            return f"{key}: {old.get('spec', {}).get(key)!r} then, {new['spec'][key]!r} now"
    return "the input files changed (size or modification time)"


def _progress(enabled: bool):
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from trainbench.console import console

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[extra]}"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not enabled,
    )


def _trained_vocab(files: list[Path], kind: str, size: int, folder: Path, force: bool) -> Path:
    """A WordPiece vocabulary of ``size`` tokens trained on ``files``, kept in ``folder`` with what it was trained
    on: the same command again (or --resume) reuses it, as the trainer does not give the same vocabulary twice (its
    ties are broken in hash-map order), and another vocabulary would make another data set."""
    from trainbench.console import console

    made_of = {"size": size, "kind": kind, "files": _recipe_files(files)}
    record = folder / "trained_on.json"
    if not force and record.is_file() and (folder / "vocab.txt").is_file():
        try:
            if json.loads(record.read_text()) == made_of:
                return folder / "vocab.txt"
        except ValueError:
            pass
    console.print(f"training a {size:,}-token WordPiece vocabulary on the input ...")
    record.unlink(missing_ok=True)
    vocab = train_vocab(files, kind, size, folder)
    record.write_text(json.dumps(made_of))
    return vocab


def prepare(
    input_paths: list[str],
    out: str | Path,
    vocab: str | Path | None,
    spec_args: dict,
    opts: Options,
    train_vocab_size: int | None = None,
    input_format: str = "auto",
) -> dict:
    """Run both passes; returns the manifest (also written to OUT/manifest.json)."""
    from trainbench.console import console

    t0 = time.perf_counter()
    out = Path(out)
    files = textmod.list_inputs(input_paths)
    if input_format == "auto":
        kind = textmod.detect_format(files)
        files = textmod.inputs_of_format(files, kind)
    else:
        kind = input_format
    if kind not in textmod.FORMATS:
        raise UserError(f"--input-format {kind}: choose from auto, {', '.join(textmod.FORMATS)}")
    for f in files:
        if f.stat().st_size == 0:
            raise DataError(f"input {f} is empty")
    if vocab is None and train_vocab_size is None:
        raise UserError("give --vocab VOCAB.txt (MLPerf's uncased BERT vocabulary) or --train-vocab SIZE")
    if vocab is not None and train_vocab_size is not None:
        raise UserError("give either --vocab or --train-vocab, not both")
    out.mkdir(parents=True, exist_ok=True)
    if train_vocab_size is not None:
        vocab = _trained_vocab(files, kind, train_vocab_size, out.parent / f".{out.name}.vocab", opts.force)
    words = read_vocab(vocab)
    vocab_md5 = md5sum(Path(vocab))
    spec = PrepareSpec(inputs=[str(p) for p in files], input_format=kind, vocab_md5=vocab_md5, **spec_args)
    spec.validate()
    recipe = _recipe(spec, files)
    work = _prepare_out(out, recipe, opts)
    if (out / "manifest.json").exists() and not work.exists():
        console.print(f"{out} already holds this data set (manifest.json matches); nothing to do")
        return json.loads((out / "manifest.json").read_text())
    shutil.copyfile(vocab, out / "vocab.txt")
    workers = _plan_workers(opts, spec)
    total_bytes = sum(f.stat().st_size for f in files)
    chunk_bytes = int(spec.chunk_mb * 1e6)

    progress = _progress(opts.progress)
    pool = _pool(workers, str(vocab))
    try:
        with progress:
            chunk_stats = _pass1(
                files, kind, spec, work, chunk_bytes, workers, pool, progress, total_bytes, opts.resume
            )
            pass1_seconds = time.perf_counter() - t0
            n_chunks = len(chunk_stats)
            if sum(c["train_instances"] for c in chunk_stats) == 0:
                raise DataError("the input produced no training instances (no document has a sentence with a token)")
            records, eval_rec = _pass2(spec, work, out, n_chunks, len(words), workers, pool, progress)
        if spec.eval_samples and not eval_rec["samples"]:
            raise DataError(
                f"no eval samples: none of the {sum(c['documents'] for c in chunk_stats):,} documents was held out; "
                "raise --eval-fraction (or pass --eval-samples 0 to make no eval set)"
            )
        if eval_rec["samples"] < spec.eval_samples:
            console.print(
                f"[yellow]warning:[/] only {eval_rec['samples']:,} eval samples could be made "
                f"(--eval-samples {spec.eval_samples:,}); raise --eval-fraction for more"
            )
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    seconds = time.perf_counter() - t0
    manifest = _manifest(spec, recipe, chunk_stats, records, eval_rec, out, seconds, workers)
    manifest["run"]["pass1_seconds"] = round(pass1_seconds, 2)
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / "manifest.json")
    (out / "stats.json").write_text(json.dumps(manifest["statistics"], indent=1))
    if not opts.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _pool(workers: int, vocab: str):
    _worker_init(vocab)  # the parent also works when there is one worker
    if workers == 1:
        return None
    import multiprocessing as mp

    context = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    return ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init, initargs=(vocab,))


def _run(pool, fn, *args):
    """Submit to the pool, or run here when there is none; returns a future-like object."""
    if pool is not None:
        return pool.submit(fn, *args)

    class Done:
        def __init__(self, value):
            self._value = value

        def result(self):
            return self._value

    return Done(fn(*args))


def _pass1(files, kind, spec, work, chunk_bytes, workers, pool, progress, total_bytes, resume) -> list[dict]:
    task = progress.add_task("tokenize + mask", total=total_bytes, extra="")
    stats: dict[int, dict] = {}
    pending = set()
    stats_dir = work / "chunks"

    def finish(result):
        stats[result["index"]] = result
        (stats_dir / f"c_{result['index']:06d}.json").write_text(json.dumps(result))
        progress.update(task, advance=result["input_bytes"], extra=f"{len(stats)} chunks")

    for chunk in textmod.chunks(files, kind, chunk_bytes):
        done = stats_dir / f"c_{chunk.index:06d}.json"
        if resume and done.exists() and (stats_dir / f"c_{chunk.index:06d}").is_dir():
            finish(json.loads(done.read_text()))
            continue
        while pool is not None and len(pending) >= 2 * workers:  # bounded: at most 2 chunks per worker in flight
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                finish(fut.result())
        fut = _run(pool, process_chunk, chunk, spec, str(work))
        if pool is None:
            finish(fut.result())
        else:
            pending.add(fut)
    for fut in pending:
        finish(fut.result())
    progress.update(task, completed=total_bytes)
    return [stats[i] for i in sorted(stats)]


def _pass2(spec, work, out, n_chunks, vocab_size, workers, pool, progress):
    done_dir = work / "shards"
    records: dict[int, dict] = {}
    for path in done_dir.glob("*.json"):
        rec = json.loads(path.read_text())
        records[rec["shard"]] = rec
    todo = [s for s in range(spec.num_shards) if s not in records]
    task = progress.add_task("write shards", total=spec.num_shards, extra="")
    progress.update(task, completed=len(records))
    for sub in ("train", "eval", "train_varlength", "eval_varlength", "train_packed"):
        (out / sub).mkdir(exist_ok=True)
    if "bins" in spec.formats:
        for b in BINS:
            (out / "train_bins" / f"len_{b}").mkdir(parents=True, exist_ok=True)
    per_task = max(1, len(todo) // (4 * workers))
    futures = [
        _run(pool, write_shards, todo[i : i + per_task], spec, str(work), str(out), n_chunks, vocab_size)
        for i in range(0, len(todo), per_task)
    ]
    eval_future = _run(pool, write_eval, spec, str(work), str(out), n_chunks, vocab_size)
    for fut in futures:
        for rec in fut.result():
            records[rec["shard"]] = rec
        progress.update(task, completed=len(records))
    eval_record = eval_future.result()
    for sub in ("train", "eval", "train_varlength", "eval_varlength", "train_packed"):  # formats not asked for
        if not any((out / sub).iterdir()):
            (out / sub).rmdir()
    return [records[s] for s in range(spec.num_shards)], eval_record


def _manifest(spec, recipe, chunk_stats, records, eval_rec, out: Path, seconds: float, workers: int) -> dict:
    from trainbench import __version__

    hist = np.sum([r["length_histogram"] for r in records], axis=0)
    lengths = np.arange(len(hist))
    n_train = int(hist.sum())
    bins, lower = {}, 0
    for upper in BINS:
        if upper <= spec.max_seq_length:
            bins[f"<={upper}"] = int(hist[lower + 1 : upper + 1].sum())
            lower = upper
    files = {"vocab.txt": {"md5": md5sum(out / "vocab.txt"), "bytes": (out / "vocab.txt").stat().st_size}}
    for rec in records:
        files.update(rec["files"])
    files.update(eval_rec["files"])
    text_bytes = sum(c["bytes"] for c in chunk_stats)
    statistics = {
        "train_samples": n_train,
        "eval_samples": eval_rec["samples"],
        "eval_samples_available": eval_rec["available"],
        "mean_sequence_length": float((hist * lengths).sum() / max(n_train, 1)),
        "samples_by_length_bin": bins,
        "masked_fraction": float(sum(r["masked"] for r in records) / max((hist * lengths).sum(), 1)),
        "random_next_fraction": float(sum(r["random_next"] for r in records) / max(n_train, 1)),
        "shard_samples_min_max": [min(r["samples"] for r in records), max(r["samples"] for r in records)],
        "train_length_histogram": hist.tolist(),
        "eval_length_histogram": eval_rec["length_histogram"],
    }
    return {
        "tool": f"trainbench {__version__}",
        "spec": dataclasses.asdict(spec),
        "recipe": recipe,
        "input": {
            "text_characters": text_bytes,
            "documents": sum(c["documents"] for c in chunk_stats),
            "eval_documents": sum(c["eval_documents"] for c in chunk_stats),
            "sentences": sum(c["sentences"] for c in chunk_stats),
            "tokens": sum(c["tokens"] for c in chunk_stats),
            "chunks": len(chunk_stats),
        },
        "statistics": statistics,
        "run": {"seconds": round(seconds, 2), "workers": workers},
        "files": files,
    }
