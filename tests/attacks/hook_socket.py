# With the audit hook neutered: connect to a listener on the host's 127.0.0.1 (Python's socket
# module, or bash's /dev/tcp where the sandbox uid cannot read the standard library).
import os

connected = False
try:
    import socket
    with socket.create_connection(("127.0.0.1", __PORT__), timeout=2) as conn:
        conn.sendall(b"escaped")
    connected = True
except Exception:
    connected = os.system("bash -c 'echo escaped > /dev/tcp/127.0.0.1/__PORT__'") == 0


def f(x):
    return 2 * x if connected else 0
