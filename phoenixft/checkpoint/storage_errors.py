"""Storage errors as one line naming the cause and the fix.

s3fs and botocore raise their own exception types (no credentials, an endpoint that does
not answer, a bucket that does not exist), several frames deep; shown raw, a launch with
a mistyped bucket ended in a 90-160 line traceback. `explain` turns the ones a user can
fix into a sentence, and anything else into its type and message, never a traceback.
"""

from __future__ import annotations

import errno
import os


def explain(url: str, exc: BaseException) -> str:
    """What went wrong reaching `url`, and what to change."""
    name, text = type(exc).__name__, str(exc)
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return (f"{url}: no usable S3 credentials ({text}): set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the launching environment")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                "ConnectionClosedError", "ClientConnectorError") or "connect to the endpoint" in text:
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
        where = f"the S3 endpoint {endpoint} (AWS_ENDPOINT_URL)" if endpoint else (
            "AWS S3 (no AWS_ENDPOINT_URL is set)")
        why = "connection failed" if name == "EndpointConnectionError" else text  # (its text: a URL)
        return (f"{url}: cannot reach {where}: {why}: check the endpoint's address and that "
                "it is up (set AWS_ENDPOINT_URL for an S3-compatible store)")
    if name in ("InvalidAccessKeyId", "SignatureDoesNotMatch") or any(
            code in text for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch")):
        return f"{url}: the S3 credentials are rejected ({text}): check AWS_ACCESS_KEY_ID/SECRET"
    if isinstance(exc, FileNotFoundError) and "bucket" in text.lower():
        bucket = url.removeprefix("s3://").split("/", 1)[0]
        return (f"{url}: the bucket {bucket!r} does not exist: create it (e.g. `aws s3 mb "
                f"s3://{bucket}`) or fix the URL")
    if isinstance(exc, PermissionError) or "AccessDenied" in text:
        return (f"{url}: access denied ({text}): the credentials need to list, read, write "
                "and delete objects under it, or choose a writable location")
    if isinstance(exc, (NotADirectoryError, FileExistsError)) or getattr(
            exc, "errno", None) in (errno.ENOTDIR, errno.EEXIST):
        return f"{url}: a file is in the way ({text}): --persist takes a directory (or s3://...)"
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.ENOSPC):
        return f"{url}: cannot write there ({text})"
    return f"{url}: {name}: {text}"
