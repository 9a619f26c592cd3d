"""An S3-compatible server for the tests: moto's, in a thread of the test process on a free port, with the AWS
variables every client here (and every process started from here) reads pointing at it. No network, nobody's
credentials."""
from __future__ import annotations

import contextlib
import logging
import os

from minitrain.runtime.launch import free_port

AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


@contextlib.contextmanager
def s3_server(bucket: str):
    """Start the server, make `bucket`, and yield an s3fs filesystem on it; the environment is restored after."""
    from moto.server import ThreadedMotoServer

    from minitrain.checkpoint import remote

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    saved = {k: os.environ.get(k) for k in AWS_VARIABLES}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    # fsspec keeps one filesystem per set of options, which here would still be talking to an earlier server.
    remote.s3_filesystem_class().clear_instance_cache()
    try:
        fs, _ = remote.store(f"s3://{bucket}")
        fs.mkdir(bucket)
        yield fs
    finally:
        server.stop()
        remote.s3_filesystem_class().clear_instance_cache()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
