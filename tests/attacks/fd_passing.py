# Pass descriptors where no one will read them: into a unix socket pair's own queue, the pair's
# own descriptors among them (a cycle only the kernel's garbage collector ends), with a filled
# file of the working directory, the directory itself and a memfd; close everything and exit.
import array
import os

sent = False
try:
    import socket
    left, right = socket.socketpair(socket.AF_UNIX)
    path = os.path.join(os.getcwd(), "passed")
    held = [os.open(path, os.O_RDWR | os.O_CREAT, 0o600), os.open(os.getcwd(), os.O_RDONLY)]
    os.write(held[0], b"x" * (4 << 20))
    try:
        held.append(os.memfd_create("passed"))
        os.write(held[-1], b"x" * (4 << 20))
    except OSError:
        pass
    fds = array.array("i", held + [left.fileno(), right.fileno()])
    for sock in (left, right):
        sock.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    sent = True
except (ImportError, OSError):
    pass
os._exit(0)


def f(x):
    return 0
