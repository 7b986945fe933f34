"""A first program for `agentrl sandbox exec`: what does the sandbox look like from inside?"""

import os
import socket
import sys

print(f"Python {sys.version.split()[0]} as uid {os.getuid()} in {os.getcwd()}")
try:
    socket.create_connection(("1.1.1.1", 53), timeout=1)
    print("network: reachable")
except OSError as e:
    print(f"network: {e.strerror}")
try:
    with open("/etc/hostname", "a"):
        pass
except OSError as e:
    print(f"root filesystem: {e.strerror}")
print("squares:", [i * i for i in range(8)])
