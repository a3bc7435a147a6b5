"""``gpufeed shard SRC DEST``: an ImageFolder -> deterministic WebDataset tar shards + manifest.

Pipeline (the format it writes: docs/design.md §2): scan -> validate (parallel, batched per task) -> plan
(seeded shuffle, N equal shards) -> write -> ``index.parquet``, the other readers' indexes (timm's ``_info.json``,
``wids.json``, DALI's ``.idx`` per shard, written from the layout the writer wrote: ``gpufeed.shardset.sidecars``) and, last
and atomically, ``manifest.json``.
With ``--check header`` and no transcoding option, validate, plan and write are first tried as one pass ("One
pass" below).
No torch import anywhere on this path.

Phase map (one module a step; this package's ``__init__`` only re-exports the public names; each module's public
names, without an underscore, are what ``job.py`` uses):

* ``job.py``: ``write_shards``, the entry: checks SRC and DEST, takes the lock, then ``_run`` calls the phases in
  order: ``_scan_phase``, ``_plan_phase`` (resume, the one pass, or ``_validate_and_plan``), ``_write_phase``,
  ``_finish_phase``. Seams for tests: ``try_one_pass`` and ``pool_factory``.
* ``context.py``: ``JobContext`` (what every phase reads) and the process set-up (``make_pool``, ``preload``).
* ``scan.py``: walking SRC into the candidate files, as columns (``scan_src`` -> ``Scan``; the class folders in
  the workers).
* ``validate.py``: per-file checks, ``--check header``/``full``, and the transcodes, in the workers
  (``inspect_file``, ``_validate_chunk``, with ``CheckOptions``); the batches fed and gathered by the main
  process (``validate_candidates`` -> ``Results``).
* ``onepass.py``: the one pass (``one_pass`` -> ``Written`` or ``validate.Partial``).
* ``shardplan.py``: the plan (``make_plan`` -> ``Plan`` of ``PlannedShard``), its fingerprint, and
  ``plan.json``/``plan.bin`` (``PLAN_VERSION``, ``save_plan``, ``read_plan``). Not ``gpufeed/memplan.py``.
* ``write.py``: the shards' bytes: worker write tasks (``write_range``, ``_write_shard`` from a ``ShardPart``, the
  one pass's ``check_and_write_shard`` from a ``OnePassPart``), member layout and in-order hashing
  (``_ShardJob``), each shard renamed with its ``.done.json`` sidecar (``finish_shard``, ``shard_complete``:
  :mod:`gpufeed.core.dest`); ``write_all`` runs the ``WriteTask`` list.
* ``finish.py``: ``index.parquet``, the sidecar indexes and ``manifest.json`` (``finish_set``).
* ``dest.py``: DEST's state folder: the lock (``lock_dest``), resume or refuse what is there (``load_plan``),
  cache housekeeping, free space, OS errors as one sentence (``os_error``).
* ``report.py``: ``ShardReport``, ``FileIssue``, ``render_shard`` and the progress bar (``Bar``).

Writing: with at least two shards a worker, each worker writes and hashes whole shards, from the plan's
columns for that shard. With fewer (a 3,000-image folder plans one shard), writing is parallel within a shard:
tar blocks are position-independent and every header follows from the plan, so the main process computes each
member's offset, creates the shard's temporary file at its final size (holes read as the zero padding and
end-of-archive blocks), and the workers write runs of consecutive samples at their offsets (one ``pwrite`` of the
run's members, image bytes over 1 MiB by ``sendfile``) while a thread of the main process hashes the file in order
as the runs complete. Either
way a file is renamed only once fully written and hashed, and the bytes are the same for any ``--workers``.

One pass: with ``--check header`` and neither ``--max-size`` nor ``--quality``, the run first assumes that every
candidate is accepted and passes through unchanged. The plan then follows from the scan alone, and each worker
validates and writes whole shards of it, reading each source once (its header checked from the bytes it
writes; at least two shards a worker, else the two passes are made). When every file checks out, the plan
built from those validation results is the one assumed: it is saved, then the shards are renamed into place,
so the output has the bytes of the two passes. The first file rejected, unreadable or needing a transcode
stops every worker (a stop file in ``DEST/.gpufeed``); their temporary shards are deleted and the run
validates the files not yet checked (whole batches checked by the pass are skipped), then plans and writes as
usual: such a set pays for the part of the pass written before the stop. The seeded order is shuffled in
steps (``Shuffle``: the same draws as ``random.shuffle``, which fixes the last positions first), so the workers
start on the last shards while this process shuffles the rest; a worker's task carries its files' names and
sizes and the pixel limit, so on plain JPEGs it imports neither numpy nor Pillow.

The plan is columnar (numpy arrays and one blob of file names, ~140 bytes a sample plus its path), never a
Python object per sample; records are built one shard at a time. ``--check header`` reads plain JFIF headers
itself (``plain_jpeg_size``) and leaves every other file to Pillow.

Input rules
-----------
* Classes are the sorted names of the non-hidden folders in SRC (``entry.is_dir()``, symlinks followed), so
  labels agree with ``torchvision.datasets.ImageFolder`` when SRC holds no hidden folder. ImageFolder counts
  hidden folders (``.ipynb_checkpoints``) as classes, which shifts every label after them: the report warns in
  one line naming each one. ``classes_like = "imagefolder"`` (``--classes-like imagefolder``) follows
  ImageFolder exactly (``find_classes``: every folder of SRC, hidden included; ``make_dataset``: hidden files
  and folders inside a class are candidates too); its empty classes are refused like any other, unless
  ``allow_empty_classes`` (ImageFolder's ``allow_empty``). ``classes_file`` (``--classes FILE``, read as
  ``index.read_class_list`` reads a class list) names the class folders in label order instead; other folders
  are ignored, and a name that is not a folder of SRC is refused.
* Inside a class folder every sub-folder is walked (as ImageFolder does), symlinks followed, each folder
  (device, inode) once per class, so loops end.
  Candidates carry one of ImageFolder's extensions (``.jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp``,
  any case). A directory named ``x.jpg`` is just a folder. Hidden files/folders, other extensions, stray
  files at SRC's root, special files (FIFOs, sockets) are *ignored* (file + reason in the report).
* Every file is stored once: paths that reach the same file (device, inode; symlinks followed, hard links
  included), in one class or in several, keep one path (one reached without a symlink first, then the lowest
  label, then the path); the others are *rejected* naming it. A class folder that is a symlink to another class
  thus holds no file of its own and is refused as empty (the message says why).
* A candidate is *rejected* (file + reason in the report, never an exception) when it is empty, a
  dangling symlink, not an image, undecodable or truncated (``--check full`` decodes every image;
  ``--check header`` only parses headers), or larger than ``max_pixels`` (decompression bombs; Pillow's own
  ``MAX_IMAGE_PIXELS`` guard is never disabled).
* An empty class (no accepted image) is an error naming the folder; with ``allow_empty_classes`` it keeps its
  label (no renumbering) and the report warns.

Stored bytes, colour modes and orientation
------------------------------------------
* The image member's extension names the real encoded format (``jpg``, ``png`` or ``webp``), never the input
  file name: a PNG saved as ``x.jpg`` is stored as ``KEY.png``.
* By default image bytes pass through unchanged ("copy"). Grayscale, palette, 1-bit, alpha (LA/RGBA/PA) and
  16-bit *RGB* images pass through: Pillow's ``Image.open(...).convert("RGB")`` yields 3-channel RGB for them
  (alpha is dropped, not flattened, exactly as ImageFolder's loader does).
* A few inputs are transcoded (counted in the report under ``transforms``) because a plain
  ``.convert("RGB")`` or a libjpeg-turbo / nvjpeg decoder would get them wrong:
  - ``cmyk_to_rgb_jpeg``: CMYK/YCCK JPEGs are converted to RGB by Pillow (which handles Adobe's inverted CMYK)
    and re-encoded as JPEG at quality 95 (or ``--quality``): simplejpeg / nvjpeg cannot convert CMYK.
  - ``16bit_to_png8``: 16-bit / 32-bit grayscale (Pillow mode ``I;16``/``I``/``F``) is scaled to 8 bits
    (``>> 8``) and stored as an 8-bit PNG, because ``.convert("RGB")`` would clip it to white.
  - ``to_png``: BMP/TIFF/PPM/PGM content is stored losslessly as an RGB PNG.
* ``--max-size PX`` re-encodes images whose long side exceeds PX (JPEG DCT-domain reduction where it applies, then
  Pillow's antialiased bicubic resize; never up; other
  images pass through); ``--quality Q`` re-encodes every image. Re-encoded output is always RGB JPEG
  (quality Q, default 90, 4:2:0, baseline, no metadata); alpha is dropped as above.
* EXIF orientation is **not applied**, consistently for every path: pass-through bytes keep their EXIF but
  are stored pixel-for-pixel, which is what ImageFolder's PIL loader, webdataset, simplejpeg and nvjpeg
  decode by default; re-encoded images are encoded from the stored pixel order and carry no EXIF.
  The tag is recorded as ``exif_orientation`` in ``KEY.json`` (when it is not 1) and counted in the report.

Members and keys
----------------
A sample is ``KEY.<jpg|png|webp>``, ``KEY.cls`` (label, ASCII decimal) and ``KEY.json`` (``source`` path
relative to SRC, ``class``, ``label``, stored ``width``/``height``, ``format``, ``sha256`` of the image
member, optional ``exif_orientation``, ``orig_width``/``orig_height`` when resized). KEY is
``{label:05d}_{n:07d}`` with n the position of the file among its class' accepted files in sorted path
order: no dots, unique, deterministic. Tar headers are fixed (USTAR, mtime 0, uid/gid 0, empty user/group
names, mode 0644) and members are written in plan order, so the bytes do not depend on ``--workers``.

Resume
------
The plan (fingerprint of the scanned files' paths, sizes and mtimes and of every output-affecting option,
plus the validated sample list) is kept in ``DEST/.gpufeed/plan.json`` (metadata) and ``plan.bin`` (the samples
as columns: 137 bytes a sample plus its path, in memory as on disk; plan.json records its sha256 and a plan that
does not check out is treated as a different plan); each completed shard leaves
``DEST/.gpufeed/<shard>.done.json`` with its size and sha256. A re-run with the same fingerprint skips shards
whose file matches its sidecar and writes the rest; a different fingerprint is refused unless ``overwrite``.
A run holds ``fcntl.flock`` on ``DEST/.gpufeed/lock`` (which records its pid): a second run into the same DEST is
refused, naming that pid. The worker processes die with the main process and never keep the lock, so after a
``kill -9`` (or the OOM killer) the next run takes the lock at once. A killed run leaves at most ``.<shard>.tmp``
files (full-sized but never renamed), which the next run deletes. A run refused before it wrote anything removes
the folders it created (DEST included).

A run killed during the one pass has saved no plan and renamed no shard: it leaves only ``.<shard>.tmp`` files,
and the re-run starts afresh.

A pass-through file is hashed once, at validation (its sha256 goes into ``KEY.json``), which also records the
opened file's identity (size, mtime_ns, inode, device). (The one pass writes the very bytes it validated and
hashed: there is no second read to check.) When its shard is written, the opened source must
still have that identity, else the run is refused ("changed while sharding"): any rewrite in place moves mtime
and a replacement by rename changes the inode. Not caught: a rewrite at the same size that keeps (or restores,
``touch -d``) the exact mtime_ns — re-hashing would catch it, at the cost of a third SHA-256 pass over the
input.

Disk space
----------
The candidates are validated in the seeded shard order (the accepted ones in that order are the shuffled
list), so each transcode cache file ``DEST/.gpufeed/enc-*.bin`` (``--max-size``/``--quality``/CMYK/16-bit/...)
feeds one or a few consecutive shards and is deleted as soon as they are written: DEST peaks near the output
size. Free space is checked before anything is written (estimate: the input bytes) and again, exactly, before
the shards are written. Any OS error (DEST full included) is one sentence naming path and reason: a ``DataError``
(exit 2) before the shards are written, a ``RunError`` (exit 1) once writing them has begun, as is a source file
that changed since validation.

Names
-----
Class folder names and file paths are recorded (manifest, ``.json``, ``index.parquet``, report) with bytes that
are not UTF-8 replaced by U+FFFD; files are read under their real names; labels follow the real names' order.
"""

from __future__ import annotations

from gpufeed.shard.dest import LOCK_NAME, STATE_DIR
from gpufeed.shard.job import write_shards
from gpufeed.shard.report import FileIssue, ShardReport, render_shard
from gpufeed.shard.scan import CANDIDATE_EXTENSIONS
from gpufeed.shard.shardplan import PLAN_ARRAYS_NAME, PLAN_NAME, PLAN_VERSION, plan_num_shards, split_sizes
from gpufeed.shard.validate import CMYK_QUALITY, DEFAULT_REENCODE_QUALITY

__all__ = [
    "CANDIDATE_EXTENSIONS", "CMYK_QUALITY", "DEFAULT_REENCODE_QUALITY", "LOCK_NAME", "PLAN_ARRAYS_NAME", "PLAN_NAME",
    "PLAN_VERSION", "STATE_DIR", "FileIssue", "ShardReport", "plan_num_shards", "render_shard", "split_sizes",
    "write_shards",
]
