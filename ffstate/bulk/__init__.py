"""The bulk socket: a fetch's chunks over a plain TCP connection beside the daemon's gRPC port.

gRPC in Python moves a restore's bytes at about a third of what a socket moves on the same link (``ffstate bench
bandwidth`` on loopback: fetch 1.0-1.3 GB/s against 3.4-3.6 for raw TCP), its per-message work in the interpreter
and in HTTP/2 framing. The control stays on gRPC: a ``FetchBulk`` call, token-checked like every call, checks the
request as ``Fetch`` does, reserves and encodes the chunks, and answers with the bulk port and a single-use random
ticket. The caller connects, sends the ticket, and reads the chunks framed by ``frames``; nothing else is ever read
from the connection, so a stranger costs the daemon 32 bytes and a few seconds of one of a bounded number of threads.
Where the daemon speaks TLS it has no bulk socket (it would be plaintext): fetches stay on gRPC.

``server.BulkServer`` is the daemon's side; ``client.fetch`` the caller's, which falls back to gRPC's ``Fetch``
whenever the socket cannot be used (docs/wire-format.md, "The bulk socket").
"""
