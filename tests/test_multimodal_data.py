"""data=multimodal: pixel preprocessing, placeholder runs, packing, bad documents, make_batch with media."""

import dataclasses
import json
import logging
import re

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_k3.config import DataConfig, RunConfig, compose_run_config, load_model_config
from megatron_k3.data import drawings
from megatron_k3.data.build import build_data
from megatron_k3.data.dataset import Sample, make_batch
from megatron_k3.data.documents import JsonlDocuments
from megatron_k3.data.drawings import COLORS, SyntheticDocuments, draw
from megatron_k3.data.media_tokens import MediaTokens, media_tokens_for
from megatron_k3.data.multimodal import MultimodalDataset, build_multimodal_datasets
from megatron_k3.data.pixels import MediaProcessor
from megatron_k3.errors import BadDocument, ConfigError, DataError

TOK = MediaTokens.after(300)  # above the byte tokenizer's ids 0..256
PROC = MediaProcessor(14, (2, 2), 256, 512, 4)


def byte_encode(texts):
    """A tokenizer for the tests: UTF-8 bytes + 1 (0 is the end of document)."""
    return [[b + 1 for b in t.encode()] for t in texts]


def dataset(source, seq=96, seed=0, on_bad="skip", processor=PROC, report=True):
    return MultimodalDataset(source, np.arange(len(source)), seq, seed, encode=byte_encode, eod_id=0,
                             media_tokens=TOK, processor=processor, on_bad_sample=on_bad, name="test", report=report)


class ListDocuments:
    """In-memory documents (text, images, videos) whose media handles are PIL images."""
    name = "list"

    def __init__(self, docs):
        self.docs = docs

    def __len__(self):
        return len(self.docs)

    def where(self, i):
        return f"list:{i}"

    def document(self, i):
        return self.docs[i]

    @staticmethod
    def size(h):
        return h.size

    @staticmethod
    def load(h):
        return h


def runs(tokens, placeholder):
    """[(start, length)] of the placeholder runs."""
    out, i = [], 0
    while i < len(tokens):
        if tokens[i] == placeholder:
            j = i
            while j < len(tokens) and tokens[j] == placeholder:
                j += 1
            out.append((i, j - i))
            i = j
        else:
            i += 1
    return out


def check_sample(s, seq, tok=TOK, proc=PROC):
    """A sample's runs, media and loss mask agree (the model's input convention)."""
    assert s.tokens.shape == (seq + 1,) and s.tokens.dtype == np.int64
    r = runs(s.tokens, tok.placeholder)
    assert len(r) == len(s.grid_thws) == (s.tokens == tok.begin).sum() == (s.tokens == tok.end).sum()
    for (start, n), grid in zip(r, s.grid_thws):  # media order = run order, each run exactly its grid's features
        assert n == proc.num_tokens(grid)
        assert s.tokens[start - 1] == tok.begin and s.tokens[start + n] == tok.end
        assert start + n < seq  # never cut: the whole run is in the inputs tokens[:-1]
    t, h, w = s.grid_thws.T if len(s.grid_thws) else (np.zeros(0),) * 3
    assert s.pixel_values.shape == (int((t * h * w).sum()), 3, 14, 14) and s.pixel_values.dtype == np.float32
    assert np.array_equal(s.loss_mask, ~np.isin(s.tokens[1:], tok.ids))
    assert s.doc_starts[0] == 0 and (np.diff(s.doc_starts) > 0).all()


# ---------------------------------------------------------------------------------------------- preprocessing

def test_preprocessing_by_hand():
    """30 x 17 px: no scaling (2 patches), padded with black to 56 x 28 (multiples of 14 * 2), (x/255 - 0.5)/0.5,
    patches in (row, column) order, channel-first."""
    px = np.random.default_rng(0).integers(0, 256, size=(17, 30, 3), dtype=np.uint8)
    patches, grid = PROC.image(Image.fromarray(px))
    assert grid == (1, 2, 4) and patches.shape == (8, 3, 14, 14) and patches.dtype == np.float32
    padded = np.zeros((28, 56, 3))
    padded[:17, :30] = px
    for i in range(2):
        for j in range(4):
            for c in range(3):
                want = (padded[14 * i: 14 * i + 14, 14 * j: 14 * j + 14, c] / 255 - 0.5) / 0.5
                np.testing.assert_allclose(patches[4 * i + j, c], want, rtol=0, atol=1e-6)
    assert patches[0, 1, 0, 0] == pytest.approx((px[0, 0, 1] / 255 - 0.5) / 0.5, abs=1e-6)
    assert (patches[3] == -1.0).all() and (patches[7] == -1.0).all()  # x >= 42: padding only
    gray, _ = PROC.image(Image.fromarray(px[..., 0], mode="L"))  # any mode becomes RGB
    assert np.array_equal(gray[:, 0], gray[:, 2])


def test_resize_follows_the_released_rule():
    assert PROC.fit(224, 224) == (224, 224)  # 16 x 16 = 256 patches: kept
    assert PROC.fit(448, 448) == (224, 224)  # 32 x 32: scaled by sqrt(256 / 1024)
    # 71 x 7 = 497 patches: scaled by sqrt(256 / 497) = 0.7177 to 717 x 71, padded to 728 x 84
    assert PROC.fit(1000, 100) == (717, 71) and PROC.grid(1000, 100) == (1, 6, 52)
    assert PROC.grid(100, 1000) == (1, 52, 6)
    assert PROC.grid(10, 10) == (1, 2, 2)  # below one patch: padded to 28 x 28
    side = MediaProcessor(14, (2, 2), 256, 8, 4)  # at most 8 patches a side: 300 px -> 112 px
    assert side.fit(300, 100) == (112, 37) and side.grid(300, 100) == (1, 4, 8)
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, size=(100, 300, 3), dtype=np.uint8))
    patches, grid = side.image(img)
    ref = np.zeros((56, 112, 3))
    ref[:37] = np.asarray(img.resize((112, 37), Image.Resampling.BICUBIC))
    want = ((ref / 255 - 0.5) / 0.5).reshape(4, 14, 8, 14, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, 14, 14)
    assert grid == (1, 4, 8)
    np.testing.assert_allclose(patches, want, rtol=0, atol=1e-6)


def test_video_chunks_and_feature_counts():
    frames = [Image.new("RGB", (28, 28), (40 * k, 0, 0)) for k in range(6)]
    chunks = PROC.video(frames)
    assert [g for _, g in chunks] == [(4, 2, 2), (2, 2, 2)]  # chunks of at most pos_emb_time = 4 frames
    x = chunks[0][0]
    assert x.shape == (16, 3, 14, 14)
    for k in range(4):  # (frame, patch row, patch column): patches 4k .. 4k+3 are frame k
        np.testing.assert_allclose(x[4 * k: 4 * k + 4, 0], (40 * k / 255 - 0.5) / 0.5, rtol=0, atol=1e-6)
    assert [PROC.num_tokens(g) for _, g in chunks] == [1, 1]  # a chunk's frames pool into one set of features
    assert PROC.num_tokens((1, 6, 52)) == 78
    with pytest.raises(BadDocument, match="merge_kernel_size"):
        PROC.num_tokens((1, 3, 4))
    with pytest.raises(BadDocument, match="pos_emb_time"):
        PROC.num_tokens((5, 2, 2))


# ---------------------------------------------------------------------------------------------- samples

def test_embedded_samples_are_a_pure_function_of_seed_and_index():
    ds, again = dataset(SyntheticDocuments(300), seq=128, seed=5), dataset(SyntheticDocuments(300), seq=128, seed=5)
    n = len(ds)
    assert n > 20 and len(ds.doc_ids) == 300
    for c in (0, 1, n - 1, n, n + 3, 2 * n + 7):  # across epochs, in any order
        a, b = ds.sample(c), again.sample(c)
        for f in ("tokens", "doc_starts", "pixel_values", "grid_thws", "loss_mask"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), (c, f)
    e0 = [tuple(ds.documents_of(c)) for c in range(n)]
    e1 = [tuple(ds.documents_of(n + c)) for c in range(n)]
    assert sorted(e0) == sorted(e1) and e0 != e1  # every epoch visits the same samples in a new order
    assert sorted(d for s in e0 for d in s) == list(range(300))  # each document in exactly one sample
    other = dataset(SyntheticDocuments(300), seq=128, seed=6)
    assert not np.array_equal(other.sample(0).tokens, ds.sample(0).tokens)
    grids = []
    for c in range(n):
        s = ds.sample(c)
        check_sample(s, 128)
        grids += s.grid_thws.tolist()
        want = [PROC.chunk([draw(h) for h in frames]) for d in ds.documents_of(c)
                for frames in ds._chunked(ds._media(ds.doc_ids[d])[1])]
        assert [tuple(g) for _, g in want] == [tuple(g) for g in s.grid_thws]
        if want:  # the pixels are the documents' media, in run order
            np.testing.assert_array_equal(s.pixel_values, np.concatenate([x for x, _ in want]))
    assert {g[0] for g in grids} == {1, 2, 4}  # images, and 6-frame videos in chunks of 4 and 2
    assert ds.keep_len.sum() / (n * 129) > 0.75  # byte-tokenized documents of ~80 tokens in samples of 129


def test_each_marker_is_replaced_by_its_media_runs():
    """Document tokens = its text with every marker replaced by the runs of its image or video chunks (back to back),
    then the end-of-document token."""
    src = SyntheticDocuments(120)
    ds = dataset(src, seq=128)
    seen = set()
    for d, i in enumerate(ds.doc_ids):
        text, images, videos = src.document(int(i))
        imgs, vids, want = iter(images), iter(videos), []
        for k, part in enumerate(re.split(r"(<image>|<video>)", text)):
            if k % 2 == 0:
                want += byte_encode([part])[0]
                continue
            chunks = PROC.video([draw(h) for h in next(vids)]) if part == "<video>" else [PROC.image(draw(next(imgs)))]
            seen.add((part, len(chunks)))
            for _, grid in chunks:
                want += [TOK.begin] + [TOK.placeholder] * PROC.num_tokens(grid) + [TOK.end]
        assert ds._tokens[ds._tok_off[d]: ds._tok_off[d + 1]].tolist() == want + [0]
    assert {("<video>", 2), ("<video>", 1), ("<image>", 1)} <= seen


def test_embedded_captions_describe_the_pixels():
    src, names = SyntheticDocuments(200), {v: k for k, v in COLORS.items()}
    for i in range(200):
        text, images, videos = src.document(i)
        for h in images + [f for v in videos for f in v]:
            img = draw(h)
            assert img.size == (h.width, h.height) and names[h.color] in text and h.shape in text
            assert img.getpixel((0, 0)) == h.background or img.getpixel((h.width - 1, h.height - 1)) == h.background
            if not h.shape.isdigit():
                assert img.getpixel((h.cx, h.cy)) == h.color
        if " in the " in text and len(images) == 1:  # one shape at a named place
            h = images[0]
            row, col = min(2, 3 * h.cy // h.height), min(2, 3 * h.cx // h.width)
            assert f"in the {drawings._position_name(row, col)}" in text


def test_long_document_is_cut_outside_media_runs():
    img = Image.new("RGB", (56, 28), (200, 10, 10))  # grid 2 x 4: 2 features, a run of 2 inside begin/end
    text = "x" * 20 + "<image>" + "y" * 40 + "<image>" + "z" * 10
    # tokens: x 0..19, run [20, 23], y 24..63, run [64, 67], z 68..77, end of document 78
    ds = dataset(ListDocuments([(text, [img, img], []), ("short", [], [])]), seq=65)
    assert ds.keep_len.tolist() == [64, 6] and ds.keep_media.tolist() == [1, 0]  # the cut at 66 would split a run
    s = next(ds.sample(c) for c in range(len(ds)) if len(ds.documents_of(c)) and ds.documents_of(c)[0] == 0)
    check_sample(s, 65)
    assert s.grid_thws.tolist() == [[1, 2, 4]] and s.pixel_values.shape == (8, 3, 14, 14)
    assert (s.tokens[64:] == TOK.pad).all() and not s.loss_mask[63:].any()
    cut = dataset(ListDocuments([("a" * 30 + "<image>" + "b" * 90, [img], [])]), seq=63)
    assert cut.keep_len.tolist() == [64] and cut.keep_media.tolist() == [1]  # a cut in text is exact
    # a cut that leaves only media has nothing to learn: a bad document
    only = dataset(ListDocuments([("<image><image>" + "z" * 10, [img, img], []), ("short", [], [])]), seq=7)
    assert only.doc_ids.tolist() == [1] and "only media" in only.skipped[0][1]


def test_make_batch_concatenates_media_and_masks_labels():
    ds = dataset(SyntheticDocuments(60), seq=64)
    samples = [ds.sample(c) for c in range(3)]
    assert all(len(s.grid_thws) for s in samples)
    tokens = np.stack([s.tokens for s in samples])
    for reset in (True, False):
        b = make_batch(samples, reset)
        labels, target = b.labels.reshape(3, 64), torch.from_numpy(tokens[:, 1:])
        ignored = torch.from_numpy(np.isin(tokens[:, 1:], TOK.ids))
        assert ignored.any() and (labels[ignored] == -100).all() and torch.equal(labels[~ignored], target[~ignored])
        assert torch.equal(b.input_ids.reshape(3, 64), torch.from_numpy(tokens[:, :-1]))
        assert b.pixel_values.dtype == torch.float32 and b.grid_thws.dtype == torch.int64
        assert torch.equal(b.pixel_values, torch.from_numpy(np.concatenate([s.pixel_values for s in samples])))
        assert torch.equal(b.grid_thws, torch.from_numpy(np.concatenate([s.grid_thws for s in samples])))
        # row-major over the rows, the k-th run is the k-th medium
        assert [n for _, n in runs(b.input_ids.reshape(-1).numpy(), TOK.placeholder)] == \
            [PROC.num_tokens(g) for g in b.grid_thws.tolist()]
    # text samples: no media and the labels as before, bit for bit
    text = [Sample(np.arange(10, dtype=np.int64) + r, np.array([0, 4])) for r in range(2)]
    for reset in (True, False):
        b = make_batch(text, reset)
        assert b.pixel_values is None and b.grid_thws is None
        assert torch.equal(b.labels.reshape(2, 9), torch.from_numpy(np.stack([s.tokens[1:] for s in text])))


# ---------------------------------------------------------------------------------------------- JSONL files

def _png(path, w, h, seed=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return Image.open(path).convert("RGB")


def test_jsonl_documents_with_png_files(tmp_path):
    a, b = _png(tmp_path / "a.png", 40, 30, 1), _png(tmp_path / "img" / "b.png", 60, 20, 2)
    frames = [_png(tmp_path / "clip" / f"{k}.png", 28, 28, 10 + k) for k in range(5)]
    docs = [{"text": "A photo: <image> of noise.", "images": ["a.png"]},
            {"text": "Two: <image> and <image>.", "images": ["img/b.png", str(tmp_path / "a.png")]},
            {"text": "A clip <video> of five frames.", "videos": [[f"clip/{k}.png" for k in range(5)]]},
            {"text": "Just text."}]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([json.dumps(docs[0]), "", json.dumps(docs[1]), json.dumps(docs[2]), "  ",
                               json.dumps(docs[3])]) + "\n")
    src = JsonlDocuments(path)
    assert len(src) == 4 and [src.where(i) for i in range(4)] == [f"{path}:{n}" for n in (1, 3, 4, 6)]
    ds = dataset(src, seq=160)
    assert len(ds) == 1
    s = ds.sample(0)
    check_sample(s, 160)
    media = {0: [PROC.image(a)], 1: [PROC.image(b), PROC.image(a)], 2: PROC.video(frames), 3: []}
    want = [m for d in ds.documents_of(0) for m in media[int(ds.doc_ids[d])]]
    assert [tuple(g) for g in s.grid_thws] == [g for _, g in want]
    assert sorted(tuple(g) for g in s.grid_thws) == [(1, 2, 2), (1, 2, 6), (1, 4, 4), (1, 4, 4), (4, 2, 2)]
    np.testing.assert_array_equal(s.pixel_values, np.concatenate([x for x, _ in want]))
    text = bytes(int(t) - 1 for t in s.tokens if 0 < t <= 256).decode()
    assert "A photo: " in text and "Just text." in text and "<image>" not in text


BAD = {  # case: (JSONL line 2, what the message says)
    "missing": ({"text": "<image>", "images": ["nope.png"]}, "not found"),
    "unreadable": ({"text": "<image>", "images": ["garbage.png"]}, "cannot read image"),
    "markers": ({"text": "<image> and <image>", "images": ["ok.png"]}, "markers"),
    "frames": ({"text": "<video>", "videos": [["ok.png", "wide.png"]]}, "different sizes"),
    "too_long": ({"text": "<image>", "images": ["big.png"]}, "more than a sample"),
    "json": ("{not json", "not valid JSON"),
    "merge": ({"text": "<image>", "images": ["wide.png"]}, "merge_kernel_size"),
}


class NoPadProcessor(MediaProcessor):
    """A processor that crops instead of padding, so a grid can miss the merge kernel."""

    def padded(self, width, height):
        return width - width % 14, height - height % 14


def _bad_file(tmp_path, case):
    _png(tmp_path / "ok.png", 28, 28)
    _png(tmp_path / "wide.png", 42, 28)
    _png(tmp_path / "big.png", 200, 200)  # 14 x 14 patches: 64 features, more than a sample of 49 tokens
    (tmp_path / "garbage.png").write_bytes(b"this is not a png")
    line, problem = BAD[case]
    good = json.dumps({"text": "fine <image> here", "images": ["ok.png"]})
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join([good, line if isinstance(line, str) else json.dumps(line), good]) + "\n")
    return path, problem, NoPadProcessor(14, (2, 2), 256, 512, 4) if case == "merge" else PROC


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_document_is_skipped_and_logged(tmp_path, caplog, case):
    path, problem, proc = _bad_file(tmp_path, case)
    with caplog.at_level(logging.WARNING, logger="megatron_k3.data.multimodal"):
        ds = dataset(JsonlDocuments(path), seq=48, processor=proc)
    assert ds.doc_ids.tolist() == [0, 2] and len(ds.skipped) == 1
    where, msg = ds.skipped[0]
    assert where == f"{path}:2" and problem in msg
    lines = [r.getMessage() for r in caplog.records if f"{path}:2" in r.getMessage()]
    assert len(lines) == 1 and problem in lines[0]
    for c in range(len(ds)):
        check_sample(ds.sample(c), 48)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_document_stops_the_run_naming_file_and_line(tmp_path, case):
    path, problem, proc = _bad_file(tmp_path, case)
    with pytest.raises(DataError, match=f"{path}:2: .*{problem}") as e:
        dataset(JsonlDocuments(path), seq=48, on_bad="stop", processor=proc)
    assert isinstance(e.value, ConfigError)  # the entry point reports it as one line


def test_a_file_broken_after_the_scan_is_an_error_naming_it(tmp_path):
    path, _, _ = _bad_file(tmp_path, "markers")
    ds = dataset(JsonlDocuments(path), seq=48, report=False)
    (tmp_path / "ok.png").write_bytes(b"broken")
    with pytest.raises(DataError, match=f"{path}:1: cannot decode image"):
        ds.sample(0)


# ---------------------------------------------------------------------------------------------- config

def test_multimodal_needs_a_vision_model_and_room_for_the_media_ids():
    run = RunConfig(model=load_model_config("k3_tiny"), data=DataConfig(name="multimodal"))
    with pytest.raises(ConfigError, match="model.vision.enabled"):
        build_data(run, 0)
    vl = load_model_config("k3_vl_tiny")
    assert media_tokens_for(vl, 8192) == MediaTokens(8192, 8193, 8194, 8195)
    with pytest.raises(ConfigError, match="model.vocab_size"):
        media_tokens_for(dataclasses.replace(vl, vocab_size=8195), 8192)
    with pytest.raises(ConfigError, match="model.vision.placeholder_token_id"):
        media_tokens_for(vl, 8200)  # a tokenizer whose text ids reach the placeholder
    with pytest.raises(ConfigError, match="data.on_bad_sample"):
        DataConfig(name="multimodal", on_bad_sample="ignore").validate()
    with pytest.raises(ConfigError, match="data.image_max_patches"):
        DataConfig(name="multimodal", image_max_patches=0).validate()
    with pytest.raises(ConfigError, match="data.paths"):
        run = RunConfig(model=vl, data=DataConfig(name="multimodal", paths=["/nonexistent/x.jsonl"]))
        build_multimodal_datasets(run, [(1.0, "/nonexistent/x.jsonl")], byte_encode, media_tokens_for(vl, 257), 0)


def test_data_multimodal_builds_with_the_embedded_tokenizer(monkeypatch):
    monkeypatch.setattr(drawings, "EMBEDDED_DOCUMENTS", 600)
    run, _, _ = compose_run_config(["model=k3_vl_tiny", "data=multimodal", "train.seq_length=128"])
    train, valid = build_data(run, 0)
    assert len(train) > 0 and len(valid) > 0 and len(train.doc_ids) + len(valid.doc_ids) == 600
    tok = MediaTokens.after(run.model.vision.placeholder_token_id)
    for ds in (train, valid):
        s = ds.sample(len(ds) + 1)  # second epoch
        check_sample(s, 128, tok)
        assert s.tokens.max() < run.model.vocab_size and (s.tokens == 0).sum() >= 1  # end-of-document tokens
