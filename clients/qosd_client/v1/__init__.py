"""Generated code of the qosd.v1 wire API (proto/qosd/v1/qosd.proto): scripts/gen_proto.sh.

The proto package, and so every name on the wire, is ``qosd.v1``; the modules live
here so that a gateway gets them with the client, without the daemon.
"""
