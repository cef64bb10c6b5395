"""The audit reads an archive on object storage (issue 29): a local S3 server (moto's), the
archive uploaded as the sink wrote it, and the report equal to the one from the directory, in one
process and as Dask tasks (workers reach the bucket through the same environment). Writing there
is refused with a clear error."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import date

import duckdb
import pytest
from factories import POLICY, build

from nodeshare.sinks.archive import ParquetArchive
from nodeshare.sinks.audit import audit, dask_client


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """A local S3 endpoint; the credentials and endpoint go where s3fs (and Dask workers) read them."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://{host}:{port}")
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _upload(local, bucket: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir(bucket)
    fs.put(str(local), f"{bucket}/archive", recursive=True)
    return f"s3://{bucket}/archive"


def test_an_archive_on_object_storage_audits_as_the_directory_does(tmp_path, s3):
    archive, ledger, n = build(tmp_path, partitions=4, jobs=8)
    con = duckdb.connect(str(ledger))  # one tampered row, found either way
    edited = con.execute("SELECT job_id FROM charges ORDER BY job_id LIMIT 1").fetchone()[0]
    con.execute("UPDATE charges SET record = json_merge_patch(record, '{\"price\": 0.0}') WHERE job_id = ?",
                [edited])
    con.close()
    url = _upload(archive, "nodeshare-a")
    remote = ParquetArchive(url)
    assert [f.name for f in remote.files()] == [f.name for f in ParquetArchive(archive).files()]
    assert remote.count() == ParquetArchive(archive).count() and remote.retention() == {}
    listings = []
    glob = remote.fs.glob
    remote.fs.glob = lambda pattern, **kw: listings.append(pattern) or glob(pattern, **kw)
    try:  # (fsspec shares the filesystem instance: the wrapper goes again after)
        for _ in range(3):
            remote.files("node.ipc")
            remote.sources_sql("node.ipc")
    finally:
        del remote.fs.glob
    assert len(listings) == 1  # a read-only archive is listed once per topic, not at every use
    here = audit(archive, ledger, POLICY)
    there = audit(url, ledger, POLICY)
    assert there.as_dict() == here.as_dict() and {m.job_id for m in there.mismatches} == {edited}
    assert there.charges_checked == n and there.fast_path_jobs > 0
    with dask_client(workers=2) as client:  # started after the environment names the endpoint
        assert audit(url, ledger, POLICY, client=client).as_dict() == here.as_dict()


def test_object_storage_is_read_never_written(tmp_path, s3):
    archive, _, _ = build(tmp_path, partitions=1, jobs=4)
    remote = ParquetArchive(_upload(archive, "nodeshare-b"))
    with pytest.raises(ValueError, match="read only here"):
        remote.prune(date(2100, 1, 1))
    with pytest.raises(ValueError, match="read only here"):
        remote.compact()
    with pytest.raises(ValueError, match="read only here"):
        remote.write("node.ipc", [])


def test_the_cli_audits_an_s3_url(tmp_path, s3):
    from typer.testing import CliRunner

    from nodeshare.cli import app

    archive, ledger, n = build(tmp_path, partitions=2, jobs=4)
    url = _upload(archive, "nodeshare-c")
    result = CliRunner().invoke(app, ["audit", "--archive", url, "--ledger", str(ledger), "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["ok"] and body["charges_checked"] == n
