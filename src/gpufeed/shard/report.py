"""What ``gpufeed shard`` tells the user: the rejected/ignored file records (``FileIssue``), the job's record
(``ShardReport``), its text rendering (``render_shard``) and the progress bar (``Bar``) the phases update."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FileIssue:
    """One input file that was rejected or ignored, and why."""

    path: str
    """Path relative to SRC."""
    reason: str


@dataclass(frozen=True)
class ShardReport:
    """What ``write_shards`` did. ``ok`` is False only when ``strict`` and something was rejected."""

    src: str
    dest: str
    prefix: str
    num_classes: int
    num_samples: int
    """Images converted into the shard set."""
    num_rejected: int
    num_ignored: int
    num_shards: int
    num_shards_written: int
    num_shards_skipped: int
    """Shards already complete from an earlier, interrupted run (resume)."""
    total_bytes: int
    """Sum of the set's shard file sizes (kept and written)."""
    input_bytes: int
    """Bytes of the accepted input files."""
    written_samples: int
    """Samples in the shards written by this run (skipped shards of a resume excluded)."""
    written_bytes: int
    """Bytes of the shards written by this run."""
    written_input_bytes: int
    """Input bytes of the samples written by this run."""
    elapsed_s: float
    validate_s: float
    write_s: float
    samples_per_s: float
    """Samples written by this run per second of the whole run."""
    mb_per_s: float
    """Input MB (1e6 bytes) written by this run per second of the whole run."""
    workers: int
    strict: bool
    resumed: bool
    """The earlier run's plan was used as it was (validation skipped); complete shards can be kept without it."""
    transforms: dict[str, int]
    """Samples per storage action: copy, reencode, cmyk_to_rgb_jpeg, 16bit_to_png8, to_png."""
    num_exif_oriented: int
    """Images with an EXIF orientation other than 1 (recorded, not applied)."""
    classes: list[str]
    empty_classes: list[str]
    warnings: list[str]
    rejected: list[FileIssue]
    ignored: list[FileIssue]
    shards: list[str]
    url_pattern: str
    manifest: str
    """``manifest.json``'s path; "" while a static split's other nodes have shards to write."""
    num_nodes: int = 1
    """Nodes of a static split (``--num-nodes``); 1 without."""
    node_rank: int = 0
    num_shards_missing: int = 0
    """Shards of other nodes not complete yet (a static split): the set is finished by the node that writes the
    last one, or by ``gpufeed shard DEST --finish``."""
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ok", not (self.strict and self.num_rejected > 0))


def render_shard(report: ShardReport, max_items: int = 20) -> str:
    """A short human summary: converted, rejected (file + reason), ignored (file + reason), shards, bytes."""
    r = report
    if r.num_shards_missing:
        return (f"node {r.node_rank} of {r.num_nodes}: wrote {r.num_shards_written} shard(s) ({r.written_samples} "
                f"images, {r.written_bytes / 1e6:.1f} MB in {r.elapsed_s:.1f} s), {r.num_shards_skipped} complete; "
                f"{r.num_shards_missing} of {r.num_shards} shards are other nodes' and not complete yet: the node "
                f"that completes the last one writes the index and manifest (or run `gpufeed shard {r.dest} "
                f"--finish` once every node is done)")
    lines = [
        f"converted {r.num_samples} images in {r.num_classes} classes -> {r.num_shards} shards "
        f"({r.url_pattern}) in {r.dest}",
        f"  set: {r.total_bytes / 1e6:.1f} MB in {r.num_shards} shards from {r.input_bytes / 1e6:.1f} MB input",
        f"  this run: {r.num_shards_written} shard(s), {r.written_samples} images, {r.written_bytes / 1e6:.1f} MB "
        f"written in {r.elapsed_s:.1f} s ({r.samples_per_s:.0f} images/s, {r.mb_per_s:.1f} MB/s input, "
        f"{r.workers} workers; validate {r.validate_s:.1f} s, write {r.write_s:.1f} s)",
    ]
    if r.resumed or r.num_shards_skipped:
        how = "resumed" if r.resumed else "re-validated (the transcode cache was gone)"
        lines.append(f"  {how}: {r.num_shards_skipped} complete shard(s) kept, {r.num_shards_written} written")
    stored = ", ".join(f"{k} {v}" for k, v in r.transforms.items())
    lines.append(f"  stored: {stored}; EXIF orientation recorded, not applied: {r.num_exif_oriented}")
    for title, items in (("rejected", r.rejected), ("ignored", r.ignored)):
        lines.append(f"  {title}: {len(items)}")
        for it in items[:max_items]:
            lines.append(f"    {it.path}: {it.reason}")
        if len(items) > max_items:
            lines.append(f"    ... and {len(items) - max_items} more (see --json)")
    for w in r.warnings:
        lines.append(f"  warning: {w}")
    if not r.ok:
        lines.append(f"FAILED (--strict): {r.num_rejected} file(s) rejected")
    return "\n".join(lines)


class Bar:
    """One tqdm bar on stderr: samples/s, plus MB/s in the postfix."""

    def __init__(self, enabled: bool) -> None:
        self.bar = None
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.mb = 0.0

    def start(self, desc: str, total: int) -> None:
        if not self.enabled:
            return
        from gpufeed.core.progress import bar

        if self.bar is None:  # drawn only on a terminal (gpufeed.core.progress); notes are printed either way
            self.bar = bar(total=total, desc=desc, unit="img", smoothing=0.1)
        else:
            self.bar.reset(total=total)
            self.bar.set_description(desc)
        self.t0 = time.perf_counter()
        self.mb = 0.0

    def update(self, n: int, nbytes: int = 0) -> None:
        if self.bar is None:
            return
        self.mb += nbytes / 1e6
        self.bar.update(n)
        dt = time.perf_counter() - self.t0
        if dt > 0:
            self.bar.set_postfix_str(f"{self.mb / dt:.1f} MB/s", refresh=False)

    def note(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
