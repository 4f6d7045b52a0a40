"""`trainbench prepare bert` from raw text: readers, tokenizer, instances, masking, packing, the pipeline."""

from __future__ import annotations

import bz2
import json
import random
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import REPO, run_cli

from trainbench.data import prepare_bert as pb
from trainbench.data.bert_hdf5 import fixed_arrays, validate_shard
from trainbench.data.packing import lpfhp, pack, packed_predictions
from trainbench.data.pretraining import InstanceSpec, _truncated, create_instances
from trainbench.data.text import READERS, document_sentences
from trainbench.data.wordpiece import FastWordPiece
from trainbench.errors import DataError

SHARED = REPO.parent / "shared" / "data"
REAL_VOCAB = SHARED / "bert" / "vocab.txt"
SPECIAL = {"[CLS]": 1, "[SEP]": 2, "[MASK]": 3}


# -- small corpora the tests make ---------------------------------------------------------------------------


def _words(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "to", "ri", "mu", "sen", "lo", "pa", "ne", "vi", "dor", "sha", "tu"]
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))))
    return sorted(words)


WORDS = _words(300)


def write_vocab(path: Path, words=WORDS, specials=("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")) -> Path:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = list(specials) + letters + ["##" + c for c in letters] + list(".,;!?") + list(words)
    path.write_text("\n".join(tokens) + "\n")
    return path


def write_results4(folder: Path, docs: int = 300, files: int = 3, seed: int = 0) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    per_file = docs // files
    for f in range(files):
        out = []
        for _ in range(per_file):
            sentences = [
                " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20))).capitalize() + "."
                for _ in range(rng.randint(5, 40))
            ]
            out.append("\n".join(sentences))
        (folder / f"part-{f:05d}-of-{files:05d}").write_text("\n\n".join(out) + "\n")
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return write_results4(root / "results4"), write_vocab(root / "vocab.txt")


def prepare_args(corpus, out: Path, *extra) -> list[str]:
    text, vocab = corpus
    return [
        "prepare", "bert", "--input", str(text), "--vocab", str(vocab), "--out", str(out),
        "--max-seq-length", "128", "--max-predictions", "20", "--dupe-factor", "3", "--num-shards", "4",
        "--eval-samples", "100", "--eval-fraction", "0.2", "--chunk-mb", "0.03", "--no-progress", *extra,
    ]  # fmt: skip


def file_md5s(out: Path) -> dict[str, str]:
    return {k: v["md5"] for k, v in json.loads((out / "manifest.json").read_text())["files"].items()}


# -- readers ---------------------------------------------------------------------------------------------------

WIKI_XML = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
  <page><title>Lobster</title><ns>0</ns><id>1</id><revision><text>{{Infobox animal|name=Lobster}}
'''Lobsters''' are [[crustacean|marine crustaceans]] of the family Nephropidae.&lt;ref&gt;A book.&lt;/ref&gt; They \
live on the sea floor.

== Anatomy ==
Lobsters have ten legs. The front legs carry claws.
</text></revision></page>
  <page><title>Homard</title><ns>0</ns><id>2</id><redirect title="Lobster" />
    <revision><text>#REDIRECT [[Lobster]]</text></revision></page>
  <page><title>Talk:Lobster</title><ns>1</ns><id>3</id>
    <revision><text>Talk text that is not an article.</text></revision></page>
  <page><title>Crab</title><ns>0</ns><id>4</id>
    <revision><text>'''Crabs''' walk sideways. They have a shell.</text></revision></page>
</mediawiki>
"""


def test_wiki_xml_reader_strips_markup_and_skips_redirects_and_other_namespaces(tmp_path):
    dump = tmp_path / "enwiki-test-pages-articles.xml.bz2"
    dump.write_bytes(bz2.compress(WIKI_XML.encode()))
    docs = [document_sentences("wiki-xml", raw) for raw, _ in READERS["wiki-xml"](dump)]
    assert docs == [
        [
            "Lobsters are marine crustaceans of the family Nephropidae.",
            "They live on the sea floor.",
            "Lobsters have ten legs.",
            "The front legs carry claws.",
        ],
        ["Crabs walk sideways.", "They have a shell."],
    ]


def test_wikitext_reader_splits_articles_and_fixes_its_escapes(tmp_path):
    path = tmp_path / "wiki.txt"
    path.write_text(
        " \n = Alpha = \n \n The state @-@ of @-@ the @-@ art costs 1 @,@ 000 dollars . It is <unk> good . \n"
        " \n = = Section = = \n \n Second paragraph here . \n = Beta = \n \n Beta text . \n"
    )
    docs = [document_sentences("wikitext", raw) for raw, _ in READERS["wikitext"](path)]
    assert len(docs) == 2
    assert docs[0][:2] == ["The state-of-the-art costs 1,000 dollars .", "It is good ."]
    assert not any("=" in s or "<unk>" in s for d in docs for s in d)


# -- tokenizer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_kind", ["real", "small"])
def test_fast_wordpiece_gives_the_ids_of_the_tokenizers_library(vocab_kind, tmp_path):
    if vocab_kind == "real":
        if not REAL_VOCAB.exists():
            pytest.skip(f"{REAL_VOCAB} is absent (the MLPerf vocabulary lives outside the repository)")
        vocab = REAL_VOCAB
    else:
        vocab = write_vocab(tmp_path / "vocab.txt")
    tok = FastWordPiece(vocab)
    texts = [
        "Héllo wörld, naïve café! 北京欢迎你 — ΣΑΣ σας İstanbul",
        "a\x01b c\u200bd e\u00a0f tab\there\u2028line \u00adsoft don't_stop-me now…",
        "x" * 150 + " ends; (brackets) [and] {braces} 3.14 $5 #tag @user ~tilde `tick`",
        " ".join(WORDS[:50]).upper(),
    ]
    wikitext = SHARED / "text" / "wikitext-2" / "valid.txt"
    if wikitext.exists():
        texts += wikitext.read_text().splitlines()[:400]
    for text in texts:
        assert tok.encode(text) == tok.encode_reference(text), text[:80]


# -- instances ---------------------------------------------------------------------------------------------


def _documents(n_docs=200, seed=0, consecutive=False):
    """Tokenized documents; with ``consecutive`` every token id is one more than the one before it."""
    rng = random.Random(seed)
    docs, next_id = [], 10
    for _ in range(n_docs):
        doc = []
        for _ in range(rng.randint(1, 40)):
            n = rng.randint(1, 30)
            if consecutive:
                doc.append(list(range(next_id, next_id + n)))
                next_id += n
            else:
                doc.append([rng.randrange(10, 1000) for _ in range(n)])
        docs.append(doc)
    return docs


DEFAULT_SPEC = InstanceSpec(max_seq_length=128, max_predictions=20, dupe_factor=3)


def _make(docs, spec=DEFAULT_SPEC, vocab=1000, seed=0):
    return create_instances(docs, spec, vocab, SPECIAL, random.Random(seed), np.random.default_rng(seed))


def test_instances_are_cls_a_sep_b_sep_and_a_real_next_sentence_continues_a():
    spec = InstanceSpec(max_seq_length=128, max_predictions=20, dupe_factor=2)
    inst = _make(_documents(consecutive=True), spec, vocab=10**6)
    assert len(inst) > 1000 and inst.lengths.max() <= 128 and inst.lengths.min() >= 5
    for i in range(len(inst)):
        row = inst.tokens[inst.offsets[i] : inst.offsets[i + 1]].copy()
        pos = inst.mask_pos[inst.mask_offsets[i] : inst.mask_offsets[i + 1]]
        row[pos] = inst.mask_ids[inst.mask_offsets[i] : inst.mask_offsets[i + 1]]  # undo the masking
        la = inst.len_a[i]
        assert row[0] == SPECIAL["[CLS]"] and row[la + 1] == SPECIAL["[SEP]"] and row[-1] == SPECIAL["[SEP]"]
        a, b = row[1 : la + 1], row[la + 2 : -1]
        assert len(a) >= 1 and len(b) >= 1
        assert (np.diff(a) == 1).all() and (np.diff(b) == 1).all()  # truncation only trims the ends
        if inst.nsp[i] == 0:
            assert b[0] > a[-1]  # B follows A in the same document (A may lose its tail, B its head)


def test_masking_statistics_follow_80_10_10():
    spec = InstanceSpec(max_seq_length=128, max_predictions=20, dupe_factor=5)
    inst = _make(_documents(400), spec)
    lengths = inst.lengths
    counts = np.diff(inst.mask_offsets)
    want = np.minimum(20, np.maximum(1, np.round(lengths * 0.15).astype(int)))
    assert (counts == want).all()
    owner = np.repeat(np.arange(len(inst)), counts)
    positions = inst.mask_pos
    assert (positions > 0).all() and (positions < lengths[owner] - 1).all()
    assert (positions != inst.len_a[owner] + 1).all(), "a [SEP] was masked"
    # Positions are distinct and increasing within each instance.
    same = owner[1:] == owner[:-1]
    assert (np.diff(positions)[same] > 0).all()
    now = inst.tokens[inst.offsets[owner] + positions]
    original = inst.mask_ids
    n = len(now)
    assert n > 50_000
    masked = (now == SPECIAL["[MASK]"]).mean()
    kept = (now == original).mean()
    replaced = ((now != original) & (now != SPECIAL["[MASK]"])).mean()
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and abs(replaced - 0.1) < 0.01
    assert abs(counts.sum() / lengths.sum() - 0.15) < 0.01


def test_next_sentence_labels_are_balanced():
    rng = random.Random(1)
    # Long documents: the forced random B of a document's single-sentence last chunk stays rare.
    docs = [[[rng.randrange(10, 1000) for _ in range(rng.randint(3, 15))] for _ in range(rng.randint(150, 250))]
            for _ in range(60)]  # fmt: skip
    inst = _make(docs)
    assert len(inst) > 3000
    assert 0.48 < inst.nsp.mean() < 0.53


def _reference_pairs(documents, max_seq_length, short_seq_prob, dupe_factor, rng):
    """create_instances_from_document's sentence-pair control flow, written out on token lists as in the
    original (truncation via the shared closed form, whose draws the two then share)."""
    max_tokens = max_seq_length - 3
    out = []
    for _ in range(dupe_factor):
        for doc_index, document in enumerate(documents):
            target = max_tokens
            if rng.random() < short_seq_prob:
                target = rng.randint(2, max_tokens)
            chunk, length, i = [], 0, 0
            while i < len(document):
                chunk.append(document[i])
                length += len(document[i])
                if i == len(document) - 1 or length >= target:
                    a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                    tokens_a = [t for s in chunk[:a_end] for t in s]
                    tokens_b = []
                    if len(chunk) == 1 or rng.random() < 0.5:
                        is_random = 1
                        for _ in range(10):
                            other = rng.randint(0, len(documents) - 1)
                            if other != doc_index:
                                break
                        random_doc = documents[other]
                        for j in range(rng.randint(0, len(random_doc) - 1), len(random_doc)):
                            tokens_b.extend(random_doc[j])
                            if len(tokens_b) >= target - len(tokens_a):
                                break
                        i -= len(chunk) - a_end
                    else:
                        is_random = 0
                        tokens_b = [t for s in chunk[a_end:] for t in s]
                    a0, a1, b0, b1 = _truncated(0, len(tokens_a), 0, len(tokens_b), max_tokens, rng)
                    out.append((tokens_a[a0:a1], tokens_b[b0:b1], is_random))
                    chunk, length = [], 0
                i += 1
    return out


def test_sentence_pairs_follow_the_reference_control_flow():
    from trainbench.data.pretraining import make_spans

    docs = _documents(80, seed=3, consecutive=True)
    flat, bounds = [], []
    for doc in docs:
        starts = [len(flat)]
        for sentence in doc:
            flat.extend(sentence)
            starts.append(len(flat))
        bounds.append(np.array(starts))
    spans = make_spans(bounds, InstanceSpec(max_seq_length=128), random.Random(5), dupe_factor=2)
    reference = _reference_pairs(docs, 128, 0.1, 2, random.Random(5))
    assert len(spans) == len(reference) > 500
    for (a0, a1, b0, b1, nsp), (a, b, ref_nsp) in zip(spans, reference, strict=True):
        assert (flat[a0:a1], flat[b0:b1], nsp) == (a, b, ref_nsp)


def test_truncation_matches_the_reference_loop():
    rng = random.Random(0)
    for _ in range(2000):
        la, lb, top = rng.randint(1, 300), rng.randint(1, 300), rng.randint(2, 300)
        a = list(range(la))
        b = list(range(lb))
        while len(a) + len(b) > top:  # Google's truncate_seq_pair, counting which segment loses a token
            (a if len(a) > len(b) else b).pop()
        a0, a1, b0, b1 = _truncated(0, la, 1000, 1000 + lb, top, rng)
        assert (a1 - a0, b1 - b0) == (len(a), len(b))
        assert 0 <= a0 <= a1 <= la and 1000 <= b0 <= b1 <= 1000 + lb


# -- packing -----------------------------------------------------------------------------------------------


def test_lpfhp_places_every_sequence_once_within_limits():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(5, 129, 3000), np.full(2000, 128)])
    hist = np.bincount(lengths, minlength=129)
    plan = lpfhp(hist, 128, 3)
    placed = np.zeros(129, int)
    for pack_lengths, count in plan:
        assert sum(pack_lengths) <= 128 and len(pack_lengths) <= 3
        for length in pack_lengths:
            placed[length] += count
    assert (placed == hist).all()
    rows = sum(count for _, count in plan)
    assert rows < len(lengths) * 0.8  # packing saves rows on this mix


def test_packed_rows_give_the_loss_of_the_same_sequences_unpacked():
    from trainbench.benchmarks.bert import BertBenchmark
    from trainbench.families.encoder.model import BertConfig, BertForPreTraining

    spec = InstanceSpec(max_seq_length=64, max_predictions=10, dupe_factor=1, short_seq_prob=0.5)
    inst = _make(_documents(60), spec)
    torch.manual_seed(0)
    model = BertForPreTraining(
        BertConfig(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                   max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
    ).double()  # fmt: skip
    bench = BertBenchmark()
    columns = packed_predictions(64, 10, 0.15, 3)
    packed = pack(inst, 64, 3, columns, np.random.default_rng(0))
    assert len(packed["input_ids"]) < len(inst)  # some rows do hold several sequences
    fixed = fixed_arrays(inst, 64, 10)
    losses = []
    for arrays in (fixed, packed):
        batch = {k: torch.from_numpy(np.asarray(v)).long() for k, v in arrays.items()}
        weights = bench.loss_weights(batch)
        losses.append(bench.loss(model, batch, weights).item())
        assert weights[1].item() == len(inst)
    # The model runs in float64; the loss casts logits to float32, hence float32's tolerance.
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


# -- the pipeline ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    assert run_cli(*prepare_args(corpus, out, "--workers", "1", "--formats", "fixed,varlength,bins,packed")) == 0
    return out


def test_prepare_writes_every_format_with_a_manifest(prepared, corpus):
    manifest = json.loads((prepared / "manifest.json").read_text())
    vocab_size = len(corpus[1].read_text().split())
    for rel, info in manifest["files"].items():
        assert pb.md5sum(prepared / rel) == info["md5"], rel
    train = sorted((prepared / "train").glob("*.hdf5"))
    assert [p.name for p in train] == [f"part_{i:05d}_of_00004.hdf5" for i in range(4)]
    n_train = sum(validate_shard(p, 128, 20).num_samples for p in train)
    st = manifest["statistics"]
    assert n_train == st["train_samples"] > 1000
    assert st["eval_samples"] == 100 and validate_shard(prepared / "eval" / "eval_100.hdf5", 128, 20).num_samples == 100
    assert sum(st["train_length_histogram"]) == n_train
    assert abs(st["masked_fraction"] - 0.15) < 0.01 and 0.45 < st["random_next_fraction"] < 0.6
    lo, hi = st["shard_samples_min_max"]
    assert hi - lo <= manifest["input"]["chunks"]  # round-robin dealing keeps shards even
    with h5py.File(train[0]) as f:
        assert int(f["input_ids"][()].max()) < vocab_size
        fixed = {k: f[k][()] for k in f}
    # The variable-length copy holds the same samples, unpadded.
    with h5py.File(prepared / "train_varlength" / train[0].name) as f:
        lengths = fixed["input_mask"].sum(1)
        assert [len(r) for r in f["input_ids"]] == lengths.tolist()
        assert all((r == fixed["input_ids"][i, : lengths[i]]).all() for i, r in enumerate(f["input_ids"]))
        assert (f["next_sentence_labels"][()] == fixed["next_sentence_labels"]).all()
    # The 4-bin split holds each sample once, in the bin its length belongs to.
    binned = 0
    for upper in (128,):
        with h5py.File(prepared / "train_bins" / f"len_{upper}" / train[0].name) as f:
            binned += len(f["input_ids"])
            assert f["input_ids"].shape[1] == upper
    assert binned == len(lengths)
    with h5py.File(prepared / "train_packed" / train[0].name) as f:
        assert int((f["next_sentence_labels"][()] >= 0).sum()) == len(lengths)
        assert f["input_ids"].shape[1] == 128


def test_output_is_byte_identical_for_any_worker_count(corpus, prepared, tmp_path):
    out = tmp_path / "w3"
    assert run_cli(*prepare_args(corpus, out, "--workers", "3", "--formats", "fixed,varlength,bins,packed")) == 0
    assert file_md5s(out) == file_md5s(prepared)


def test_an_interrupted_run_resumes_to_the_same_bytes(corpus, prepared, tmp_path, monkeypatch, capsys):
    out = tmp_path / "resumed"
    args = prepare_args(corpus, out, "--workers", "1", "--formats", "fixed,varlength,bins,packed")
    real_write = pb._write_formats
    calls = {"n": 0}

    def crash_on_third_shard(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as if stopped mid-way through pass 2
        return real_write(*a, **k)

    monkeypatch.setattr(pb, "_write_formats", crash_on_third_shard)
    assert run_cli(*args) == 130
    monkeypatch.setattr(pb, "_write_formats", real_write)
    assert not (out / "manifest.json").exists()
    done = sorted(p.name for p in (out / ".work" / "shards").glob("*.json"))
    assert done == ["00000.json", "00001.json"]
    capsys.readouterr()
    assert run_cli(*args) == 2  # refuses to mix runs without --resume
    assert "--resume" in capsys.readouterr().out
    assert run_cli(*args, "--resume") == 0
    assert file_md5s(out) == file_md5s(prepared)
    assert not (out / ".work").exists()
    assert run_cli(*args, "--resume") == 0  # complete already: nothing to do
    assert "nothing to do" in capsys.readouterr().out


def test_an_interruption_in_the_first_pass_resumes_to_the_same_bytes(corpus, prepared, tmp_path, monkeypatch):
    out = tmp_path / "resumed1"
    args = prepare_args(corpus, out, "--workers", "1", "--formats", "fixed,varlength,bins,packed")
    real_process = pb.process_chunk

    def crash_on_chunk_4(chunk, *a):
        if chunk.index == 4:
            raise KeyboardInterrupt
        return real_process(chunk, *a)

    monkeypatch.setattr(pb, "process_chunk", crash_on_chunk_4)
    assert run_cli(*args) == 130
    monkeypatch.setattr(pb, "process_chunk", real_process)
    assert len(list((out / ".work" / "chunks").glob("c_*.json"))) == 4
    assert run_cli(*args, "--resume") == 0
    assert file_md5s(out) == file_md5s(prepared)


def test_memory_bound_lowers_the_worker_count(corpus, tmp_path, capsys):
    spec = pb.PrepareSpec([], "results4", "", chunk_mb=4)  # about 0.42 GB per worker
    assert pb._plan_workers(pb.Options(workers=8, max_memory_gb=1.0), spec) == 2
    assert run_cli(*prepare_args(corpus, tmp_path / "o", "--max-memory-gb", "0.1")) == 2
    assert "--max-memory-gb" in _error_line(capsys)


def test_a_shard_interrupted_while_written_never_has_its_final_name(tmp_path, monkeypatch):
    from trainbench.data import bert_hdf5

    def dies_after_the_first_dataset(self, name, **kw):
        if name != "input_ids":
            raise KeyboardInterrupt
        return real(self, name, **kw)

    real = h5py.File.create_dataset
    monkeypatch.setattr(h5py.File, "create_dataset", dies_after_the_first_dataset)
    arrays = {k: np.zeros((4, 8), np.int32) for k in bert_hdf5.KEYS}
    with pytest.raises(KeyboardInterrupt):
        bert_hdf5.write_shard(tmp_path / "part_00000_of_00001.hdf5", arrays)
    assert not (tmp_path / "part_00000_of_00001.hdf5").exists()


def test_prepared_data_trains_fixed_and_packed(prepared, corpus, tmp_path, capsys):
    vocab_size = len(corpus[1].read_text().split())
    for layout in ("fixed", "packed"):
        capsys.readouterr()
        code = run_cli(
            "run", "bert", f"data.dir={prepared}", f"output.results_dir={tmp_path / layout}",
            f"model.vocab_size={vocab_size}", "data.max_predictions=20", "eval_samples=100",
            "schedule.max_samples=256", "eval.every_samples=128", "progress=false", f"data.layout={layout}",
        )  # fmt: skip
        assert code == 1  # 256 samples do not reach the target: status aborted, but the run completes
        run_dir = next((tmp_path / layout).iterdir())
        outcome = json.loads((run_dir / "run_0.json").read_text())
        assert outcome["samples"] >= 256 and outcome["final_metric"] is not None
        # the console names the kernel auto picked for packed rows (on a CPU with gradients: the dense mask)
        note = "attention over packed rows: sdpa (model.packed_attention=auto)"
        assert (note in capsys.readouterr().out) == (layout == "packed")


def test_train_vocab_makes_a_usable_vocabulary_and_the_same_command_again_is_nothing_to_do(corpus, tmp_path, capsys):
    text, _ = corpus
    out = tmp_path / "tv"
    command = (
        "prepare", "bert", "--input", text, "--train-vocab", "200", "--out", out, "--max-seq-length", "128",
        "--max-predictions", "20", "--dupe-factor", "1", "--num-shards", "2", "--eval-samples", "20",
        "--eval-fraction", "0.1", "--no-progress", "--workers", "1",
    )  # fmt: skip
    assert run_cli(*command) == 0
    vocab = (out / "vocab.txt").read_text().split("\n")
    assert {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"} <= set(vocab)
    with h5py.File(out / "train" / "part_00000_of_00002.hdf5") as f:
        assert int(f["input_ids"][()].max()) < len([w for w in vocab if w])
    # The trainer breaks its ties differently in each process; the vocabulary trained once is kept and reused.
    capsys.readouterr()
    assert run_cli(*command) == 0
    printed = capsys.readouterr().out
    assert "nothing to do" in printed and "training a" not in printed, printed
    assert (out / "vocab.txt").read_text().split("\n") == vocab


# -- bad input: one clear sentence, exit code 2 -----------------------------------------------------------


def _error_line(capsys) -> str:
    out = capsys.readouterr().out.strip()
    assert out.startswith("error:") and "\n" not in out and "Traceback" not in out, out
    return out


def test_each_benchmark_prepares_with_its_own_options_and_another_ones_is_named(tmp_path, capsys):
    out = tmp_path / "d"
    assert run_cli("prepare", "llama2_70b_lora", "--synthetic", "--preset", "tiny", "--vocab", "/nonexistent",
                   "--workers", "9", "--out", out) == 2  # fmt: skip
    assert "--vocab is an option of `prepare bert`, not of `trainbench prepare llama2_70b_lora`" in _error_line(capsys)
    assert not out.exists()
    assert run_cli("prepare", "llama2_70b_lora", "--synthetic", "--workers=9", "--out", out) == 2
    assert "--workers is an option of `prepare bert / llama31_8b / gpt3 / gpt_oss_20b`" in _error_line(capsys)
    assert run_cli("prepare", "bert", "--synthetic", "--bogus", "--out", out) == 2
    assert "--bogus is not an option of `trainbench prepare bert`" in _error_line(capsys)
    helps = {}
    for name in ("bert", "llama31_8b", "llama2_70b_lora"):
        with pytest.raises(SystemExit):
            run_cli("prepare", name, "--help")
        helps[name] = capsys.readouterr().out
        assert "every benchmark's options" in helps[name] and "--out" in helps[name] and "--synthetic" in helps[name]
    assert "--vocab" in helps["bert"] and "--tokenizer" not in helps["bert"] and "--train-tokens" not in helps["bert"]
    assert "--train-tokens" in helps["llama31_8b"] and "--vocab" not in helps["llama31_8b"]
    assert "--train-samples" not in helps["llama31_8b"]
    assert "--train-samples" in helps["llama2_70b_lora"] and "--vocab" not in helps["llama2_70b_lora"]
    assert "--workers" not in helps["llama2_70b_lora"] and "--eod-token" not in helps["llama2_70b_lora"]


def test_truncated_bz2_is_one_clear_error(corpus, tmp_path, capsys):
    dump = tmp_path / "enwiki-cut-pages-articles.xml.bz2"
    data = bz2.compress((WIKI_XML * 50).encode())
    dump.write_bytes(data[: len(data) // 2])
    args = ["prepare", "bert", "--input", dump, "--vocab", corpus[1], "--out", tmp_path / "o", "--no-progress"]
    assert run_cli(*args) == 2
    assert "truncated" in _error_line(capsys)


def test_empty_input_file_is_one_clear_error(corpus, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert run_cli("prepare", "bert", "--input", empty, "--vocab", corpus[1], "--out", tmp_path / "o") == 2
    assert "is empty" in _error_line(capsys)


def test_vocab_without_mask_is_one_clear_error(corpus, tmp_path, capsys):
    vocab = write_vocab(tmp_path / "vocab.txt", specials=("[PAD]", "[UNK]", "[CLS]", "[SEP]"))
    assert run_cli("prepare", "bert", "--input", corpus[0], "--vocab", vocab, "--out", tmp_path / "o") == 2
    assert "[MASK]" in _error_line(capsys)


def test_missing_input_and_bad_flags_are_clear_errors(corpus, tmp_path, capsys):
    assert run_cli("prepare", "bert", "--input", tmp_path / "nope", "--vocab", corpus[1], "--out", tmp_path / "o") == 2
    assert "does not exist" in _error_line(capsys)
    assert run_cli(*prepare_args(corpus, tmp_path / "o2", "--formats", "fixed,zip")) == 2
    assert "zip" in _error_line(capsys)
    with pytest.raises(DataError, match="vocabulary"):
        FastWordPiece(tmp_path / "no-vocab.txt")


def test_flex_attention_and_dense_masks_give_the_same_packed_loss():
    import dataclasses

    from trainbench.benchmarks.bert import BertBenchmark
    from trainbench.families.encoder.model import BertConfig, BertForPreTraining

    spec = InstanceSpec(max_seq_length=64, max_predictions=10, dupe_factor=1, short_seq_prob=0.5)
    inst = _make(_documents(40), spec)
    packed = pack(inst, 64, 3, packed_predictions(64, 10, 0.15, 3), np.random.default_rng(0))
    batch = {k: torch.from_numpy(np.asarray(v)).long() for k, v in packed.items()}
    cfg = BertConfig(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                     max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    bench = BertBenchmark()
    losses = []
    for attention in ("auto", "sdpa"):
        torch.manual_seed(0)
        model = BertForPreTraining(dataclasses.replace(cfg, packed_attention=attention)).eval()
        with torch.no_grad():  # FlexAttention's backward needs CUDA (tests/test_gpu_bert.py covers it there)
            assert model.packed_kernel(torch.device("cpu")) == ("flex" if attention == "auto" else "sdpa")
            losses.append(bench.loss(model, batch, bench.loss_weights(batch)).item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    # Training with attention dropout in fp32 keeps the dense path: FlexAttention has no dropout. In bf16 on
    # CUDA the varlen flash kernel takes packed rows, dropout or not (tests/test_gpu_bert.py).
    dropout = BertForPreTraining(dataclasses.replace(cfg, attention_dropout=0.1)).train()
    assert dropout.packed_kernel(torch.device("cuda")) == "sdpa"
    import trainbench.families.encoder.model as bert

    with pytest.MonkeyPatch.context() as patch:  # without the cuDNN frontend (with it, auto takes cudnn)
        patch.setattr(bert, "cudnn_unavailable", lambda: "not installed")
        assert dropout.bfloat16().packed_kernel(torch.device("cuda")) == "varlen"
    with pytest.raises(ValueError, match="varlen runs on CUDA in bf16"):
        BertForPreTraining(dataclasses.replace(cfg, packed_attention="varlen")).packed_kernel(torch.device("cpu"))


def test_varlen_segments_cover_every_sequence_and_the_padding_of_each_row():
    from trainbench.families.encoder.model import varlen_segments

    sequence_ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [1, 2, 3, 3, 3, 3, 0, 0]])
    segments = varlen_segments(sequence_ids, 3)
    # per row: sequences 1, 2, 3, then padding; empty slots are zero-length sequences
    assert segments.cu_seqlens.tolist() == [0, 3, 5, 5, 8, 16, 16, 16, 16, 17, 18, 22, 24]
    assert segments.cu_seqlens.dtype == torch.int32 and segments.max_len == 8


def test_cudnn_segments_give_lengths_and_element_offsets_in_the_fused_projection_and_the_output():
    from trainbench.families.cudnn_attention import cudnn_segments
    from trainbench.families.encoder.model import varlen_segments

    sequence_ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    segments = cudnn_segments(*varlen_segments(sequence_ids, 3), hidden=32)
    starts = [0, 3, 5, 5, 8, 16, 16, 16, 16]  # token where each slot starts (sequences 1-3, then padding)
    assert segments.lengths.flatten().tolist() == [3, 2, 0, 3, 8, 0, 0, 0]
    # [tokens, 3, heads, head_dim]: a token is 3 x 32 elements in the projection and 32 in the output
    assert segments.offsets_qkv.flatten().tolist() == [96 * t for t in starts]
    assert segments.offsets_out.flatten().tolist() == [32 * t for t in starts]
    assert all(t.shape[1:] == (1, 1, 1) and t.dtype == torch.int32 for t in segments[:3])
    assert segments.max_len == 8


def test_cudnn_attention_is_chosen_only_by_name_and_only_where_it_can_run(monkeypatch):
    import trainbench.families.encoder.model as bert
    from trainbench.families.encoder.model import BertConfig, BertForPreTraining, packed_kernel_unavailable

    gpu = dict(cuda=True, half=True, grad=True, dropout=True)
    monkeypatch.setattr(bert, "cudnn_unavailable", lambda: None)  # as with the cuDNN frontend installed
    assert packed_kernel_unavailable("cudnn", **gpu) is None
    assert "runs on CUDA in bf16" in packed_kernel_unavailable("cudnn", **gpu | {"half": False})
    assert "runs on CUDA in bf16" in packed_kernel_unavailable("cudnn", **gpu | {"cuda": False})
    model = BertForPreTraining(BertConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2,
                                          intermediate_size=64, max_position_embeddings=16)).bfloat16()  # fmt: skip
    assert model.packed_kernel(torch.device("cuda")) == "cudnn"  # auto takes it where it can run
    assert model.float().packed_kernel(torch.device("cuda")) != "cudnn"  # not in fp32
    model.bfloat16()
    monkeypatch.setattr(bert, "cudnn_unavailable", lambda: "needs the cuDNN frontend: pip install x")
    assert "pip install" in packed_kernel_unavailable("cudnn", **gpu)
    assert model.packed_kernel(torch.device("cuda")) == "varlen"  # auto falls back to flash attention
    model.cfg.packed_attention = "cudnn"
    with pytest.raises(ValueError, match="needs the cuDNN frontend"):
        model.packed_kernel(torch.device("cuda"))


def test_fixed_rows_turn_back_into_the_instances_they_were_written_from():
    """instances_from_fixed inverts fixed_arrays: the synthetic generator's rows (short ones included) go to
    Instances and back unchanged, so packing them packs exactly these samples."""
    from trainbench.data.packing import instances_from_fixed
    from trainbench.data.synthetic_bert import Language, make_samples

    rng = np.random.default_rng(0)
    fixed = make_samples(Language(1024, 0), rng, 300, 128, 20, short_seq_prob=0.5)
    inst = instances_from_fixed(fixed)
    assert len(inst) == 300 and int(inst.lengths.min()) < 64  # short samples are there
    again = fixed_arrays(inst, 128, 20)
    for key, value in fixed.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)
