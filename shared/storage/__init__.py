"""The shared-volume and S3 contract as code (the layout is in the README's Architecture section).

One module per concern:

- `files`: atomic writes, JSONL, `staged_dir` (a folder that appears whole, manifest written last);
- `manifest`: `manifest.json` (sha256 + size per file), the mark of a complete folder;
- `volume`: `SharedVolume` (paths by name), step folders, the latest complete checkpoint, complete exports;
- `ids`: the rule for run and adapter ids (they become folder names and S3 keys);
- `s3`: S3 URIs and the boto3 client; `local_s3`: the loopback S3-compatible endpoint;
- `skyrl_exports`: sealing exports SkyRL writes without a manifest (an explicit step, never a side effect of reading).
"""
