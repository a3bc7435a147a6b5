"""Labels where other tools keep them: ``gpufeed index --label cls|txt|json:FIELD [--classes FILE]``, the
manifest's ``label`` source, and the loader and verify reading it (docs/design.md §2.2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufeed.config import LoaderConfig
from gpufeed.core.errors import DataError
from gpufeed.shardset.manifest import (MAX_LABEL_JSON_BYTES, LabelError, MissingLabel, read_label, read_manifest)
from gpufeed.core.world import World
from tests.common.cli import invoke, invoke_json
from tests.common.shards import write_image, write_tar

# (key, caption/.txt class name, json "label", json "label_id") as img2dataset-like samples, in tar order
SAMPLES = [("000000000", "dog", "cat", 3), ("000000001", "cat", "dog", 0), ("000000002", "dog", "bird", 1),
           ("000000003", "cat", "cat", 3)]


def _jpeg(tmp_path: Path, i: int) -> bytes:
    return write_image(tmp_path / "img" / f"{i}.jpg", size=(20, 16), color=(30 * i, 60, 90)).read_bytes()


def _member_json(caption: str, **fields) -> bytes:
    return json.dumps({"caption": caption, "url": "http://example.invalid/x.jpg", "status": "success",
                       **fields}).encode()


def img2dataset_set(tmp_path: Path, name: str = "i2d", *, drop: dict[str, str] | None = None,
                    big_json: str | None = None) -> Path:
    """A folder with one shard as img2dataset writes it: KEY.jpg, KEY.json, KEY.txt and no .cls. ``drop`` maps a
    key to the json field it lacks; ``big_json`` names a key whose .json is over MAX_LABEL_JSON_BYTES."""
    d = tmp_path / name
    d.mkdir()
    members = []
    for i, (key, text, label, label_id) in enumerate(SAMPLES):
        fields = {"label": label, "label_id": label_id}
        for k, f in (drop or {}).items():
            if k == key:
                fields.pop(f)
        meta = _member_json(text, **fields)
        if key == big_json:
            meta = _member_json("x" * MAX_LABEL_JSON_BYTES, **fields)
        members += [(f"{key}.jpg", _jpeg(tmp_path, i)), (f"{key}.json", meta), (f"{key}.txt", text.encode())]
    write_tar(d / "00000.tar", members)
    return d


def load_labels(d: Path, **kw) -> tuple[list[int], int]:
    from gpufeed.loader import build_loader

    loader = build_loader(d, LoaderConfig(batch_size=2, num_workers=0, image_size=16, **kw), World.single(),
                          train=False)
    labels = [x for _, batch in loader for x in batch.tolist()]
    return labels, loader.num_skipped


@pytest.mark.parametrize("source, classes, expected", [
    ("txt", ["cat", "dog"], [1, 0, 1, 0]),
    ("json:label", ["bird", "cat", "dog"], [1, 2, 0, 1]),
    ("json:label_id", ["0", "1", "2", "3"], [3, 0, 1, 3]),
])
def test_index_verify_and_load_an_img2dataset_set(tmp_path, source, classes, expected):
    d = img2dataset_set(tmp_path)
    res = invoke_json(["index", d, "--label", source])
    assert res["ok"] and res["label"] == source and res["num_unlabeled"] == 0 and res["num_samples"] == 4
    m = read_manifest(d)
    assert m.label == source and m.classes == classes
    assert json.loads((d / "manifest.json").read_text())["label"] == source
    assert invoke_json(["verify", d, "--workers", "1"])["ok"]
    assert load_labels(d) == (expected, 0)


def test_index_without_cls_names_where_the_labels_are(tmp_path):
    """The new user's first try: no .cls member anywhere. One sentence that names --label, no traceback."""
    d = img2dataset_set(tmp_path)
    res = invoke(["index", d], expect=2)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert "no sample in" in lines[0] and "has a .cls label" in lines[0]
    assert "take the labels from them with --label txt or --label json:FIELD" in lines[0]
    assert not (d / "manifest.json").exists()
    res = invoke(["index", d, "--label", "json:class"], expect=2)  # a field no sample has: shows what they have
    assert "no field 'class' in its .json member (its fields: caption, url, status, label, label_id)" in res.stderr


def test_classes_file_fixes_the_order(tmp_path):
    d = img2dataset_set(tmp_path)
    order = tmp_path / "order.txt"
    order.write_text("dog\ncat\n")
    res = invoke_json(["index", d, "--label", "txt", "--classes", order])
    assert res["class_source"] == str(order)
    assert read_manifest(d).classes == ["dog", "cat"]
    assert load_labels(d) == ([0, 1, 0, 1], 0)
    order.write_text("bird\ndog\ncat\nfox\n")  # json names mapped through the list; "fox" has no sample
    invoke(["index", d, "--label", "json:label", "--classes", order])
    assert read_manifest(d).classes == ["bird", "dog", "cat", "fox"]
    assert load_labels(d) == ([2, 1, 0, 2], 0)
    order.write_text("dog\ncat\ndog\n")
    res = invoke(["index", d, "--label", "txt", "--classes", order], expect=2)
    assert res.stderr.strip() == f"error: {order} lists class 'dog' twice"
    order.write_text("dog\n")  # "cat" is not in the list: counted and listed, the manifest written, exit 1
    res = invoke_json(["index", d, "--label", "txt", "--classes", order], expect=1)
    assert res["num_bad_labels"] == 2
    assert res["bad_labels"] == ["00000.tar: 000000001.txt (label 'cat' is neither a class index nor a class of "
                                 "the manifest)"]


def test_samples_missing_the_field_are_counted_listed_and_refused(tmp_path):
    d = img2dataset_set(tmp_path, drop={"000000002": "label"})
    res = invoke(["index", d, "--label", "json:label"], expect=1)  # the manifest is written all the same
    assert ("error: 1 sample(s) have no json:label label; the loader will reject them: 00000.tar: 000000002 "
            "(no field 'label' in its .json member (its fields: caption, url, status, label_id))") in res.stdout
    assert "Traceback" not in res.stdout + res.stderr
    m = read_manifest(d)
    assert m.label == "json:label" and m.classes == ["cat", "dog"] and m.num_samples == 4
    with pytest.raises(DataError) as info:
        load_labels(d)  # on_error = "raise"
    msg = str(info.value)
    assert "\n" not in msg and "'000000002.jpg'" in msg and "no field 'label' in its .json member" in msg
    # skipped and counted; the last batch is filled by re-reading the range (its first sample again)
    assert load_labels(d, on_error="skip") == ([0, 1, 0, 0], 1)
    rep = invoke_json(["verify", d, "--workers", "1"], expect=1)
    assert [(p["member"], p["reason"]) for p in rep["problems"]] == [
        ("000000002", "sample has no field 'label' in its .json member (its fields: caption, url, status, label_id)")]


def test_a_json_member_over_the_bound_is_not_read(tmp_path):
    d = img2dataset_set(tmp_path, big_json="000000001")
    res = invoke_json(["index", d, "--label", "json:label"], expect=1)
    assert res["num_bad_labels"] == 1 and res["num_unlabeled"] == 0
    assert res["bad_labels"] == [f"00000.tar: 000000001.json (.json member is over {MAX_LABEL_JSON_BYTES} bytes; "
                                 f"it is not read for a label)"]
    with pytest.raises(DataError, match=rf"'000000001.jpg'.*\.json member is over {MAX_LABEL_JSON_BYTES} bytes"):
        load_labels(d)
    assert load_labels(d, on_error="skip") == ([1, 0, 1, 1], 1)  # the last batch refilled from the range


@pytest.mark.parametrize("meta, message", [
    (b"[1, 2]", "not a JSON object"),
    (b"{\"label\": 1.0}", "is float 1.0, not a class index"),
    (b"{\"label\": true}", "is bool True, not a class index"),
    (b"{\"label\": null}", "is NoneType None"),
    (b"{\"label\": [\"cat\"]}", "is list"),
    (b"{\"label\": 2}", "label 2 is outside 0..1"),
    (b"{\"label\": -1}", "label -1 is outside 0..1"),
    (b"{\"label\": \"fox\"}", "label 'fox' is neither a class index nor a class of the manifest"),
    (b"{\"label\": ", "not UTF-8 JSON"),
    (b"\xff{}", "not UTF-8 JSON"),
    (b"{\"label\": \"" + b"a" * 1100 + b"\"}", "field 'label' of the .json member is 1100 bytes; a label is at most 1024"),
])
def test_read_label_refuses_what_is_not_a_label(meta, message):
    with pytest.raises(LabelError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        read_label({"json": meta}, "json:label", ["cat", "dog"])


def test_read_label_takes_each_source():
    classes = ["cat", "dog"]
    assert read_label({"cls": b"1\n"}, "cls", classes) == 1
    assert read_label({"txt": b" dog\n", "cls": b"0"}, "txt", classes) == 1
    assert read_label({"json": b'{"label": "cat", "id": 1}'}, "json:label", classes) == 0
    assert read_label({"json": b'{"label": "cat", "id": 1}'}, "json:id", classes) == 1
    assert read_label({"json": b'{"id": "1"}'}, "json:id", classes) == 1  # digits read as an index, as in .cls
    with pytest.raises(MissingLabel, match=r"no \.txt label member"):
        read_label({"cls": b"0"}, "txt", classes)
    with pytest.raises(MissingLabel, match=r"no \.json member"):
        read_label({"txt": b"cat"}, "json:label", classes)
    big = b'{"label": "cat", "pad": "' + b"x" * MAX_LABEL_JSON_BYTES + b'"}'
    with pytest.raises(LabelError, match=f"over {MAX_LABEL_JSON_BYTES} bytes"):
        read_label({"json": big}, "json:label", classes)


def _manifest_json(folder: Path, **changes) -> Path:
    d = {"format": "gpufeed-shards", "format_version": 1, "prefix": "data", "classes": ["cat", "dog"],
         "shards": [{"name": "data-000.tar", "num_samples": 3, "bytes": 10240, "sha256": None}],
         "num_samples": 3, "created_by": "gpufeed index"}
    d.update(changes)
    folder.mkdir(exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps(d))
    return folder


@pytest.mark.parametrize("source", ["pipe:x", "json:", "json:a b", "json:a.b", "json:-x", "JSON:label", "cls ",
                                    "json:" + "a" * 65, 3, None, ["cls"]])
def test_a_manifest_with_a_label_source_it_does_not_know_is_refused(tmp_path, source):
    d = _manifest_json(tmp_path / "m", label=source)
    with pytest.raises(DataError) as info:
        read_manifest(d)
    msg = str(info.value)
    assert "\n" not in msg and f"{d / 'manifest.json'}: label source" in msg
    assert "is not one this gpufeed reads (cls, txt or json:FIELD); upgrade gpufeed" in msg
    res = invoke(["verify", d], expect=2)
    assert len(res.stderr.strip().splitlines()) == 1 and "label source" in res.stderr


def test_a_manifest_label_source_is_read_and_defaults_to_cls(tmp_path):
    from gpufeed.shardset.manifest import write_manifest

    assert read_manifest(_manifest_json(tmp_path / "a")).label == "cls"
    m = read_manifest(_manifest_json(tmp_path / "w", label="cls"))
    write_manifest(tmp_path / "w", m)  # a .cls set's manifest is written as before the field existed
    assert "label" not in json.loads((tmp_path / "w" / "manifest.json").read_text())
    assert read_manifest(tmp_path / "w") == m
    assert read_manifest(_manifest_json(tmp_path / "b", label="json:label_id")).label == "json:label_id"
    assert read_manifest(_manifest_json(tmp_path / "c", label="txt")).label == "txt"


@pytest.mark.parametrize("source", ["json:", "pipe:cat x", "yaml"])
def test_index_refuses_a_label_option_it_cannot_read(tmp_path, source):
    d = img2dataset_set(tmp_path)
    res = invoke(["index", d, "--label", source], expect=2)
    assert res.stderr.startswith(f"error: --label {source!r} is refused: ")
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (d / "manifest.json").exists()


def test_a_set_labelled_from_txt_or_json_is_format_version_2_and_a_cls_set_stays_1():
    """A reader from before `label` refuses version 2 instead of labelling by .cls members the set may also hold."""
    from gpufeed.shardset.manifest import Manifest, ShardInfo

    def manifest(label: str) -> dict:
        return Manifest(prefix="a", classes=["cat", "dog"], shards=[ShardInfo("a.tar", 2, 10240, None)], num_samples=2,
                        label=label).to_dict()

    assert manifest("cls")["format_version"] == 1 and "label" not in manifest("cls")
    assert manifest("txt")["format_version"] == 2 and manifest("json:label")["format_version"] == 2
    assert Manifest.from_dict(manifest("txt")).label == "txt"
