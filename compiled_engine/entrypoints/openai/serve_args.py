"""`compiled-engine serve` options beyond the shared engine ones (no heavy imports: the CLI builds
its parser for every command)."""

from __future__ import annotations

import argparse

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, local only)"
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients pass as `model` (default: the --model argument, or 'default')",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"largest request body accepted; larger ones get 413 (default: {DEFAULT_MAX_REQUEST_BYTES})",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="skip Inductor: run the lowered graph eagerly"
    )
