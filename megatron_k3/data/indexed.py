"""Megatron-LM's indexed dataset format (PREFIX.bin tokens, PREFIX.idx index): a memory-mapped reader
and an atomic writer that produce and accept exactly the bytes megatron-core does.

Layout of PREFIX.idx (all integers little-endian, no padding):

    offset 0   9 bytes   magic b"MMIDIDX\\x00\\x00"
    offset 9   uint64    version, always 1
    offset 17  uint8     dtype code of the tokens in .bin (see DTYPE_CODES)
    offset 18  uint64    S, number of sequences
    offset 26  uint64    D, number of document offsets (= documents + 1)
    offset 34  int32[S]  sequence lengths, in tokens
               int64[S]  sequence pointers, byte offsets into .bin
               int64[D]  document indices: offsets into the sequence list, starting with 0 and ending
                         with S; document d is sequences [doc[d], doc[d + 1])
               int8[S]   optional: sequence modes (megatron-core's "multimodal" datasets), present iff
                         the file holds exactly S bytes more than the arrays above

PREFIX.bin is the token ids of all sequences back to back in the dtype named by the code.
"""

from __future__ import annotations

import logging
import os
import secrets
import struct
from array import array

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# magic, version, dtype code, sequence count, document-offset count: 9 + 8 + 1 + 8 + 8 = 34 bytes.
_HEADER = struct.Struct("<9sQBQQ")

# Megatron's dtype code table (megatron.core.datasets.indexed_dataset.DType).
DTYPE_CODES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}

# Index arrays are scanned in chunks of this many entries, so validation and index writing need O(1)
# memory beyond the (memory-mapped or compact) arrays themselves.
_CHUNK = 1 << 18
_INT32_MAX = np.iinfo(np.int32).max


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair that cannot be read (or a token that cannot be written); the message starts
    with the path of the offending file."""


def best_dtype(vocab_size: int | None) -> type:
    """The token dtype Megatron picks for a vocabulary: uint16 below 65500 entries, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def _le(dtype: np.dtype) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def _create_tmp(parent: str, name: str):
    """A new hidden temporary file beside the output (same file system, so the final rename is atomic),
    created with the usual 0o666 & ~umask permissions, unlike tempfile.mkstemp's 0o600."""
    while True:
        path = os.path.join(parent, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue


def _known_codes() -> str:
    return ", ".join(f"{code} ({dt.name})" for code, dt in DTYPE_CODES.items())



def _read_header(idx: str, expected_dtype=None):
    """Check the header of index file `idx` and its size against what the header declares: (token dtype, sequence
    count, document-offset count, whether per-sequence modes follow the arrays)."""
    idx_size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise IndexedDatasetError(f"{idx}: truncated header ({len(head)} bytes, expected {_HEADER.size})")
    magic, version, code, n_seq, n_doc = _HEADER.unpack(head)
    if magic != MAGIC:
        raise IndexedDatasetError(f"{idx}: bad magic {magic!r}, expected {MAGIC!r}; "
                                  "not a Megatron indexed-dataset index")
    if version != VERSION:
        raise IndexedDatasetError(f"{idx}: unsupported version {version}, only version {VERSION} exists")
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{idx}: unknown dtype code {code}; known codes: {_known_codes()}")
    dtype = DTYPE_CODES[code]
    if expected_dtype is not None and np.dtype(expected_dtype) != dtype:
        raise IndexedDatasetError(f"{idx}: tokens are {dtype.name} (dtype code {code}), "
                                  f"but {np.dtype(expected_dtype).name} was expected")
    if n_doc < 1:
        raise IndexedDatasetError(f"{idx}: document-offset count is 0; the index must hold "
                                  "documents + 1 >= 1 offsets")
    arrays_end = _HEADER.size + 12 * n_seq + 8 * n_doc
    if idx_size < arrays_end:
        raise IndexedDatasetError(
            f"{idx}: truncated: the header declares {n_seq} sequences and {n_doc} document offsets, "
            f"which need {arrays_end} bytes, but the file has {idx_size}")
    extra = idx_size - arrays_end
    has_modes = extra == n_seq and n_seq > 0
    if extra and not has_modes:
        raise IndexedDatasetError(
            f"{idx}: {extra} unexpected bytes after the document indices (expected 0, or {n_seq} "
            "for per-sequence modes)")
    return dtype, n_seq, n_doc, has_modes


class IndexedDataset:
    """Read-only view of a Megatron .bin/.idx pair.

    Both files are memory-mapped; opening reads the 34-byte header and, with `validate=True`
    (default), scans the index arrays in fixed-size chunks to check them (lengths >= 0, pointers
    non-decreasing and inside .bin, document indices non-decreasing). `validate=False` keeps only the
    O(1) checks (header, file sizes, first/last entries). `ds[i]` returns a read-only numpy view of
    sequence i; `ds[a:b:c]` a list of them.
    """

    def __init__(self, path_prefix, expected_dtype=None, validate: bool = True):
        self.path_prefix = os.fspath(path_prefix)
        self.idx_path = self.path_prefix + ".idx"
        self.bin_path = self.path_prefix + ".bin"
        self._expected_dtype = expected_dtype
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: file not found (an indexed dataset needs both "
                                          f"{self.path_prefix}.bin and {self.path_prefix}.idx)")
        idx = self.idx_path
        self._dtype, n_seq, n_doc, has_modes = _read_header(idx, expected_dtype)

        self._idx_map = np.memmap(idx, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self._lengths = np.frombuffer(self._idx_map, _le(np.int32), n_seq, off)
        off += 4 * n_seq
        self._pointers = np.frombuffer(self._idx_map, _le(np.int64), n_seq, off)
        off += 8 * n_seq
        self._doc_idx = np.frombuffer(self._idx_map, _le(np.int64), n_doc, off)
        off += 8 * n_doc
        self._modes = np.frombuffer(self._idx_map, np.int8, n_seq, off) if has_modes else None

        bin_size = os.path.getsize(self.bin_path)
        # np.memmap refuses empty files; a dataset of empty sequences has an empty .bin.
        self._bin = np.memmap(self.bin_path, dtype=np.uint8, mode="r") if bin_size else np.empty(0, np.uint8)
        self._bin_view = memoryview(self._bin)
        self._read_dtype = _le(self._dtype)
        self._itemsize = self._dtype.itemsize
        self._n = n_seq
        self._num_tokens = None

        if self._doc_idx[0] != 0 or self._doc_idx[-1] != n_seq:
            raise IndexedDatasetError(
                f"{idx}: document indices must start at 0 and end at the sequence count {n_seq}, "
                f"got {int(self._doc_idx[0])} ... {int(self._doc_idx[-1])}")
        if n_seq:
            end = int(self._pointers[-1]) + int(self._lengths[-1]) * self._itemsize
            if end > bin_size:
                raise IndexedDatasetError(
                    f"{self.bin_path}: truncated or corrupted: the index says the last sequence ends at "
                    f"byte {end}, but the file has {bin_size} bytes")
        # Fast path: sequences as slices of one typed view of .bin (pointers known to be aligned);
        # otherwise np.frombuffer at any byte offset, as Megatron reads.
        aligned = self._check_arrays(bin_size) if validate else False
        self._tokens = np.frombuffer(self._bin, self._read_dtype, bin_size // self._itemsize) if aligned else None
        self._shift = self._itemsize.bit_length() - 1

    def _check_arrays(self, bin_size: int) -> bool:
        """O(N) checks over the index, chunk by chunk; returns whether every pointer is a multiple of
        the token size (always so for files Megatron writes), which enables the faster read path."""
        idx, prev_ptr, aligned, isz = self.idx_path, 0, True, self._itemsize
        for s in range(0, self._n, _CHUNK):
            # Aligned copies: the arrays sit at unaligned offsets in the file, and numpy is slow on those.
            lengths = np.array(self._lengths[s:s + _CHUNK])
            ptrs = np.array(self._pointers[s:s + _CHUNK])
            if lengths.min() < 0:
                i = s + int(np.argmax(lengths < 0))
                raise IndexedDatasetError(f"{idx}: sequence {i} has negative length {int(self._lengths[i])}")
            if ptrs[0] < prev_ptr or (ptrs[1:] < ptrs[:-1]).any():
                j = 0 if ptrs[0] < prev_ptr else 1 + int(np.argmax(ptrs[1:] < ptrs[:-1]))
                before = prev_ptr if j == 0 else int(ptrs[j - 1])
                raise IndexedDatasetError(f"{idx}: sequence pointers are not monotone: pointer {s + j} is "
                                          f"{int(ptrs[j])}, below the one before it ({before})")
            ends = np.multiply(lengths, isz, dtype=np.int64)
            ends += ptrs
            if ends.max() > bin_size:
                j = int(np.argmax(ends > bin_size))
                raise IndexedDatasetError(
                    f"{self.bin_path}: truncated or corrupted: sequence {s + j} ends at byte {int(ends[j])}, "
                    f"but the file has {bin_size} bytes")
            if aligned and isz > 1:
                aligned = not (ptrs & (isz - 1)).any()
            prev_ptr = int(ptrs[-1])
        docs_all, prev_doc = self._doc_idx, 0
        for s in range(0, len(docs_all), _CHUNK):
            docs = np.array(docs_all[s:s + _CHUNK])
            if docs[0] < prev_doc or (docs[1:] < docs[:-1]).any():
                j = 0 if docs[0] < prev_doc else 1 + int(np.argmax(docs[1:] < docs[:-1]))
                raise IndexedDatasetError(f"{idx}: document indices are not monotone at document offset {s + j}")
            prev_doc = int(docs[-1])
        return aligned

    # --- reads -------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        # .item() returns Python ints, accepts negative indices and raises IndexError out of range.
        if self._tokens is not None:
            start = self._pointers.item(i) >> self._shift
            return self._tokens[start:start + self._lengths.item(i)]
        return np.frombuffer(self._bin_view, self._read_dtype, self._lengths.item(i), self._pointers.item(i))

    def get(self, i, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (to its end when length is None)."""
        n = self._lengths.item(i)
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"{self.bin_path}: get({i}, offset={offset}, length={length}) is outside "
                             f"sequence {i} of {n} tokens")
        return np.frombuffer(self._bin_view, self._read_dtype, length,
                             self._pointers.item(i) + offset * self._itemsize)

    def __iter__(self):
        for i in range(self._n):
            yield self[i]

    # --- index -------------------------------------------------------------------------------------

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32[S], tokens per sequence (a read-only view of the memory-mapped index)."""
        return self._lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64[S], byte offset of each sequence in .bin."""
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64[documents + 1]: document d is sequences [document_indices[d], document_indices[d + 1])."""
        return self._doc_idx

    @property
    def sequence_modes(self) -> np.ndarray | None:
        """int8[S] per-sequence modes of megatron-core's multimodal datasets; None when absent."""
        return self._modes

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences (summed once, in chunks, then cached)."""
        if self._num_tokens is None:
            self._num_tokens = sum(int(self._lengths[s:s + _CHUNK].sum(dtype=np.int64))
                                   for s in range(0, self._n, _CHUNK))
        return self._num_tokens

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.path_prefix!r}: {self._n} sequences, {self.num_documents} documents, "
                f"{self._dtype.name})")

    # Reopen by path when pickled (DataLoader workers under spawn); the checks already ran here.
    def __getstate__(self):
        return self.path_prefix, self._expected_dtype

    def __setstate__(self, state):
        self.__init__(state[0], expected_dtype=state[1], validate=False)


class IndexedDatasetWriter:
    """Write a .bin/.idx pair that megatron-core's IndexedDataset reads, byte-identical to what its
    IndexedDatasetBuilder writes for the same sequences.

    Tokens stream to a temporary file beside the output; the index (4 + 8 bytes per sequence) is kept
    in compact arrays. finalize() writes the index and renames both files into place (.bin first, so a
    present .idx means a complete pair). Used as a context manager it finalizes on success and removes
    its temporary files on an exception.
    """

    def __init__(self, path_prefix, dtype=np.int32):
        self.path_prefix = os.fspath(path_prefix)
        self.bin_path = self.path_prefix + ".bin"
        self.idx_path = self.path_prefix + ".idx"
        self._dtype = np.dtype(dtype)
        if self._dtype.kind not in "iu" or self._dtype not in _CODE_OF:
            writable = ", ".join(dt.name for dt in DTYPE_CODES.values() if dt.kind in "iu")
            raise ValueError(f"{self.bin_path}: cannot write tokens as {self._dtype.name}; use one of {writable}")
        self._write_dtype = _le(self._dtype)
        self._info = np.iinfo(self._dtype)
        parent, base = os.path.split(os.path.abspath(self.path_prefix))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"{parent}: output directory does not exist")
        self._bin_tmp, fd = _create_tmp(parent, base + ".bin")
        self._idx_tmp = None
        self._bin_file = os.fdopen(fd, "wb", buffering=1 << 20)
        self._lengths = array("q")
        self._doc_idx = array("q", [0])
        self._num_tokens = 0
        self._closed = False

    # --- adding ------------------------------------------------------------------------------------

    def add_item(self, tokens) -> None:
        """Append one sequence (1-D ints: list, numpy array or CPU tensor) to the current document."""
        if self._closed:
            raise RuntimeError(f"{self.bin_path}: writer is already finalized or aborted")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"{self.bin_path}: a sequence must be 1-D, got shape {arr.shape}")
        if arr.size == 0:
            arr = arr.astype(self._write_dtype)
        elif arr.dtype != self._write_dtype:
            if arr.dtype.kind not in "iub":
                raise ValueError(f"{self.bin_path}: token ids must be integers, got dtype {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._info.min or hi > self._info.max:
                bad = lo if lo < self._info.min else hi
                raise IndexedDatasetError(
                    f"{self.bin_path}: token id {bad} does not fit {self._dtype.name} "
                    f"(range {self._info.min}..{self._info.max}); write with a wider dtype")
            arr = arr.astype(self._write_dtype)
        if arr.size > _INT32_MAX:
            raise ValueError(f"{self.bin_path}: sequence of {arr.size} tokens exceeds the int32 length field")
        self._bin_file.write(np.ascontiguousarray(arr).data)
        self._lengths.append(arr.size)
        self._num_tokens += arr.size

    def end_document(self) -> None:
        """Close the current document: the sequences added since the previous end_document()."""
        if self._closed:
            raise RuntimeError(f"{self.bin_path}: writer is already finalized or aborted")
        self._doc_idx.append(len(self._lengths))

    def add_document(self, tokens) -> None:
        """Append a document made of one sequence."""
        self.add_item(tokens)
        self.end_document()

    @property
    def num_sequences(self) -> int:
        return len(self._lengths)

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    # --- finishing ---------------------------------------------------------------------------------

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        if self._closed:
            raise RuntimeError(f"{self.bin_path}: writer is already finalized or aborted")
        pending = len(self._lengths) - self._doc_idx[-1]
        if pending:
            raise ValueError(f"{self.bin_path}: {pending} sequence(s) added after the last end_document(); "
                             "call end_document() before finalize()")
        self._bin_file.flush()
        os.fsync(self._bin_file.fileno())
        self._bin_file.close()
        self._idx_tmp, fd = _create_tmp(*os.path.split(os.path.abspath(self.idx_path)))
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            self._write_index(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)
        self._closed = True

    def _write_index(self, f) -> None:
        n_seq = len(self._lengths)
        f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self._dtype], n_seq, len(self._doc_idx)))
        lengths = np.frombuffer(self._lengths, np.int64) if n_seq else np.empty(0, np.int64)
        for s in range(0, n_seq, _CHUNK):
            f.write(lengths[s:s + _CHUNK].astype("<i4").tobytes())
        start = 0  # byte offset of the next sequence: pointers are the exclusive prefix sum of sizes
        for s in range(0, n_seq, _CHUNK):
            ends = np.cumsum(lengths[s:s + _CHUNK] * self._dtype.itemsize) + start
            f.write((ends - lengths[s:s + _CHUNK] * self._dtype.itemsize).astype("<i8").tobytes())
            start = int(ends[-1])
        f.write(np.frombuffer(self._doc_idx, np.int64).astype("<i8").tobytes())

    def abort(self) -> None:
        """Drop everything written so far (the temporary files); the outputs are left untouched."""
        if self._closed:
            return
        self._closed = True
        self._bin_file.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            if tmp is not None:
                try:
                    os.remove(tmp)
                except FileNotFoundError:
                    pass

    def __del__(self):
        # A writer dropped without finalize() never produces output; do not leave its temporaries behind.
        if not getattr(self, "_closed", True):
            try:
                self.abort()
                log.warning("%s: writer discarded without finalize(); nothing was written", self.bin_path)
            except Exception:
                pass

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.finalize()
        except BaseException:
            self.abort()
            raise
