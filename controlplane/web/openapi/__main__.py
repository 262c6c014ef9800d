"""`python -m controlplane.web.openapi > docs/openapi.json`: the document of the built-in defaults.

The one module of the generator that imports the app (for its routes); the app imports the
generator, never this."""

from __future__ import annotations

import sys

from controlplane.web import app
from controlplane.web.openapi import document, encode


def main() -> None:
    # Built without a replica: the routes are described, never served.
    sys.stdout.buffer.write(encode(document(app.build(None).routes)))


if __name__ == "__main__":
    main()
