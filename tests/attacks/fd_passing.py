# Pass descriptors where no one will read them: into a unix socket pair's own queue, the pair's
# own descriptors among them (a cycle only the kernel's garbage collector ends), with memfd files
# filled as far as the file size limit allows (as many as descriptors allow), a file of the
# working directory and the directory itself; close everything and exit. What they hold must be
# freed with the program: more than the limit's __MEMORY__ bytes in flight.
import array
import os

held, fds = 0, []
try:
    import socket
    left, right = socket.socketpair(socket.AF_UNIX)
    fds.append(os.open(os.path.join(os.getcwd(), "passed"), os.O_RDWR | os.O_CREAT, 0o600))
    fds.append(os.open(os.getcwd(), os.O_RDONLY))
    chunk = b"x" * (1 << 20)
    while len(fds) < 40:
        fd = os.memfd_create("passed")
        fds.append(fd)
        try:
            while True:
                held += os.write(fd, chunk)
        except OSError:  # EFBIG: this one is full
            pass
    for sock in (left, right):
        sock.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds + [left.fileno(),
                                                                                         right.fileno()]))])
except (ImportError, OSError):
    pass
os._exit(0)


def f(x):
    return 0
