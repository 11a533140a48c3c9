"""LoRA adapters in S3 (`$S3_URI/adapters/<adapter_id>/`), the layout Ray Serve LLM's
`dynamic_lora_loading_path` reads. Readers trust an adapter only once its manifest.json is there and
every file matches it; fetched adapters are cached locally, verified, one folder per adapter id and version.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from shared.storage.ids import check_adapter_id
from shared.storage.manifest import MANIFEST, ManifestError, check_file_names, verify_manifest
from shared.storage.s3 import s3_client, split_s3_uri


class AdapterNotFound(LookupError):
    """No complete adapter with that id in S3."""


class AdapterChanging(RuntimeError):
    """An adapter whose files kept changing while they were downloaded (a re-point in progress)."""


class AdapterStore:
    """Read access to `<s3_uri>/adapters/`: list ids, read manifests, fetch into a local cache."""

    def __init__(self, s3_uri: str, endpoint_url: str | None = None, cache_dir: str | Path | None = None, client=None,
                 region: str | None = None):
        self.bucket, prefix = split_s3_uri(s3_uri)
        self.prefix = f"{prefix}/adapters".lstrip("/")
        self.client = client or s3_client(endpoint_url, region)
        self.cache_dir = Path(cache_dir or Path(tempfile.gettempdir()) / "maze-grpo-adapters")

    @classmethod
    def from_config(cls, cfg, cache_dir=None) -> AdapterStore:
        if not cfg.storage.s3_uri:
            raise ValueError("no S3_URI set: adapters in S3 need S3_URI (and AWS_ENDPOINT_URL for a local endpoint)")
        cache = cache_dir or cfg.shared_path() / "cache" / "adapters"
        return cls(cfg.storage.s3_uri, cfg.storage.aws_endpoint_url, cache, region=cfg.cluster.region)

    def key(self, adapter_id: str, name: str) -> str:
        return f"{self.prefix}/{check_adapter_id(adapter_id)}/{name}"

    def manifest(self, adapter_id: str) -> dict:
        """Returns an adapter's manifest; AdapterNotFound when it has none (absent or half-written)."""
        from botocore.exceptions import ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(adapter_id, MANIFEST))["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NoSuchBucket"):
                raise AdapterNotFound(f"adapter {adapter_id!r} not found in s3://{self.bucket}/{self.prefix}/") from None
            raise
        try:
            manifest = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ManifestError(f"adapter {adapter_id!r}: its manifest.json in S3 does not parse ({exc})") from None
        return check_file_names(manifest, f"adapter {adapter_id!r} in s3://{self.bucket}/{self.prefix}/", nested=False)

    def list(self) -> list[str]:
        """Returns the ids of adapters that have a manifest (complete ones)."""
        ids = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{self.prefix}/", Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                adapter_id = common["Prefix"][len(self.prefix) + 1 :].strip("/")
                try:
                    self.manifest_etag(adapter_id)
                    ids.append(adapter_id)
                except AdapterNotFound:
                    continue  # a folder without its manifest: an upload in progress, not an adapter yet
        return sorted(ids)

    def manifest_etag(self, adapter_id: str) -> str:
        """Returns the ETag of an adapter's manifest (it changes whenever the id is re-pointed); AdapterNotFound."""
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.key(adapter_id, MANIFEST))["ETag"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NoSuchBucket"):
                raise AdapterNotFound(f"adapter {adapter_id!r} not found in s3://{self.bucket}/{self.prefix}/") from None
            raise

    def fetch(self, adapter_id: str, manifest: dict | None = None, tries: int = 4) -> Path:
        """Returns a local folder holding one version of the adapter, downloaded and verified against its manifest.

        Each version (the files its manifest lists) gets its own folder, `<cache>/<adapter_id>/<version>/`, so a
        re-pointed alias never overwrites files a reader is using. Files that do not match the manifest (the id
        is being re-pointed while we download) are never kept: the manifest is read again and the fetch retried.
        """
        for attempt in range(tries):
            manifest = manifest or self.manifest(adapter_id)
            local = self.cache_dir / adapter_id / adapter_version(manifest)
            if _verified(local, manifest):
                return local
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=local.parent))
            try:
                for name in manifest["files"]:
                    target = tmp / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    self.client.download_file(self.bucket, self.key(adapter_id, name), str(target))
                (tmp / MANIFEST).write_text(json.dumps(manifest))
                verify_manifest(tmp)
                if _verified(local, manifest):  # another reader finished the same version first
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    shutil.rmtree(local, ignore_errors=True)
                    tmp.replace(local)
                return local
            except ManifestError:
                shutil.rmtree(tmp, ignore_errors=True)
                manifest = None
                time.sleep(0.2 * 2**attempt)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        raise AdapterChanging(f"adapter {adapter_id!r} changed while it was being downloaded ({tries} tries): "
                              "it is being re-pointed; try again in a few seconds")


def adapter_version(manifest: dict) -> str:
    """Returns a short id of the files a manifest lists (the same files give the same version)."""
    return hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()[:16]


def _verified(folder: Path, manifest: dict) -> bool:
    try:
        cached = json.loads((folder / MANIFEST).read_text())
        return cached.get("files") == manifest.get("files") and bool(verify_manifest(folder))
    except (OSError, ValueError):
        return False
