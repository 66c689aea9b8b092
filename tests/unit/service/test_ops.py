"""Save URLs must stay strictly inside the storage root."""

import os

import pytest

from models.server.paths import SaveRefused, check_save_url


def test_local_paths_inside_the_root_are_normalised(tmp_path):
    root = str(tmp_path / "root")
    inside = str(tmp_path / "root" / "run" / "critic")
    assert check_save_url(inside, root) == inside
    assert check_save_url(f"file://{inside}", root) == inside
    assert check_save_url(inside, f"file://{root}/") == inside
    assert check_save_url("run/critic", root) == inside  # relative: under the root
    assert check_save_url(str(tmp_path / "root" / "run" / "." / "critic"), root) == inside


@pytest.mark.parametrize("url, why", [
    ("../x", "contains '..'"),
    ("run/../../x", "contains '..'"),
    ("{tmp}/root/../x", "contains '..'"),
    ("{tmp}/root-evil/x", "outside the storage root"),  # shares the prefix string, not the folder
    ("{tmp}/root", "strictly inside"),
    ("{tmp}/other", "outside the storage root"),
    ("s3://bucket/root/x", r"scheme s3:// is not file://"),
])
def test_local_root_refuses_escapes(tmp_path, url, why):
    with pytest.raises(SaveRefused, match=why):
        check_save_url(url.format(tmp=tmp_path), str(tmp_path / "root"))


def test_symlink_out_of_the_root_is_refused(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "root" / "link")
    with pytest.raises(SaveRefused, match="outside the storage root"):
        check_save_url(str(tmp_path / "root" / "link" / "critic"), str(tmp_path / "root"))


def test_object_store_roots():
    root = "s3://bucket/runs"
    assert check_save_url("s3://bucket/runs/r1/critic", root) == "s3://bucket/runs/r1/critic"
    assert check_save_url("S3://bucket/runs//r1/critic/", root + "/") == "s3://bucket/runs/r1/critic"
    for url, why in [("s3://other/runs/r1", "outside"), ("s3://bucket/runs-2/r1", "outside"),
                     ("s3://bucket/runs", "strictly inside"), ("s3://bucket/runs/../x", r"'\.\.'"),
                     ("gs://bucket/runs/r1", "scheme gs://"), ("/bucket/runs/r1", "scheme file://")]:
        with pytest.raises(SaveRefused, match=why):
            check_save_url(url, root)


def test_no_root_disables_saving():
    with pytest.raises(SaveRefused, match="without --storage-root"):
        check_save_url("/tmp/x", "")
