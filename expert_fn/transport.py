"""gRPC channel and server options shared by both ends of an expert call.

Expert calls carry 0.1-64 MiB per message, far above what gRPC's defaults are tuned for (4 MiB
message cap, 16 KiB HTTP/2 frames, a 64 KiB window grown by BDP probes, 8 KiB socket reads).
Measured on loopback (2-core CPU, a 1 MiB echo over a stream, Python grpc.aio in two processes):
defaults 2.9 ms; with the window, frame, probe and read-chunk settings below 1.3 ms. Each setting
alone gains little; together they let a message cross in a few large reads.
"""

from __future__ import annotations

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # 4096 tokens of Mixtral hidden states in float32 each way
# Where frontends and expert functions on one node meet for shared-memory tensors (shm.py): the
# host's /dev/shm outside containers; in pods, a hostPath mounted at the same place in both.
DEFAULT_SHM_DIR = "/dev/shm"
# A stream's segment: the calls in flight on it at once (a decode step's call is a few MiB at most;
# a larger prefill call goes through it in parts of half of it, client.py). A GPU expert function pins
# it, so all of it is used.
DEFAULT_SHM_SEGMENT_BYTES = 16 << 20

HTTP2_WINDOW_BYTES = 64 << 20
# gRPC servers set SO_REUSEPORT by default, so a second server binds a taken port without an error and
# the two split its connections; with port 0 a server may even be handed a port another one holds
# (grpc/grpc#10755). A kubemoe server owns its port: a taken one is an error, never crosstalk.
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)


def listen(server, address: str) -> int:
    """Bind gRPC `server` (made with EXCLUSIVE_PORT) to `address`; the port it got (port 0: any free one)."""
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # grpcio raises where older releases returned 0
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address}: the address is taken or not local; choose another port")
    return port


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # A window as large as the largest message: one message never stalls for WINDOW_UPDATEs,
        # so the BDP probe (which grows the window over several round trips) is not needed.
        ("grpc.http2.lookahead_bytes", HTTP2_WINDOW_BYTES),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.max_frame_size", (1 << 24) - 1),  # the HTTP/2 maximum: fewer frame headers
        # Read the socket in large chunks: a 1 MiB message in a handful of reads, not 128.
        ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
        ("grpc.experimental.tcp_min_read_chunk_size", 1 << 20),
        ("grpc.experimental.tcp_max_read_chunk_size", 16 << 20),
    ]
