"""S3 URIs and the boto3 client, for AWS or any S3-compatible endpoint (the local one, the compose stack's)."""

from __future__ import annotations

# What an S3-compatible server of one's own accepts when the environment holds no AWS credentials.
LOCAL_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local"}


def split_s3_uri(uri: str) -> tuple[str, str]:
    """Returns (bucket, prefix) of `s3://bucket/prefix` (prefix without trailing slash)."""
    if not uri or not uri.startswith("s3://"):
        raise ValueError(f"S3 URI {uri!r} must look like s3://bucket/prefix")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"S3 URI {uri!r} has no bucket")
    return bucket, prefix.strip("/")


def endpoint_credentials(endpoint_url: str | None) -> dict:
    """Returns the credentials a process must be given to reach `endpoint_url`: none for AWS (its own chain)
    or when the chain finds some, else `LOCAL_CREDENTIALS` (S3-compatible servers accept any)."""
    import boto3

    if not endpoint_url or boto3.session.Session().get_credentials() is not None:
        return {}
    return dict(LOCAL_CREDENTIALS)


def s3_client(endpoint_url: str | None = None, region: str | None = None, retries: int = 5, timeout_s: float = 10.0):
    """Returns a boto3 S3 client: AWS with its usual credential chain and region (endpoint_url None), or an
    S3-compatible server at endpoint_url (path-style addressing, any credentials). The environment is not changed."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"max_attempts": retries, "mode": "standard"},
        connect_timeout=timeout_s,
        read_timeout=timeout_s * 3,
        s3={"addressing_style": "path"} if endpoint_url else {},
    )
    credentials = endpoint_credentials(endpoint_url)
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region or ("us-east-1" if endpoint_url else None),
                        config=config, aws_access_key_id=credentials.get("AWS_ACCESS_KEY_ID"),
                        aws_secret_access_key=credentials.get("AWS_SECRET_ACCESS_KEY"))
