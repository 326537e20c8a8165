"""gRPC server reflection under both names clients ask for: `grpc.reflection.v1`
(grpcurl, Postman, current grpc tools) and `grpc.reflection.v1alpha` (older ones,
grpcio-reflection's own client).

grpcio-reflection serves only v1alpha. v1's reflection.proto is the same protocol with
the package renamed (same messages, fields and numbers), so one servicer answers both:
its methods are registered a second time under v1's service name, and v1's file
descriptor (v1alpha's, renamed) joins the descriptor pool so that clients resolving the
v1 service by reflection find it too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_SERVICE = "grpc.reflection.v1.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
_V1ALPHA_PREFIX, _V1_PREFIX = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."


def _add_v1_descriptor() -> None:
    """v1's reflection.proto in the default pool (once; kept when something put it there)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, "grpc.reflection.v1"
    proto.options.Clear()  # v1alpha's language package options name v1alpha
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # message-typed fields only
                field.type_name = field.type_name.replace(_V1ALPHA_PREFIX, _V1_PREFIX)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(_V1ALPHA_PREFIX, _V1_PREFIX)
            method.output_type = method.output_type.replace(_V1ALPHA_PREFIX, _V1_PREFIX)
    pool.Add(proto)


def enable(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection v1 and v1alpha on `server`, listing `service_names` and both of its own."""
    _add_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer(
        (*service_names, reflection.SERVICE_NAME, V1_SERVICE))
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    for name in (reflection.SERVICE_NAME, V1_SERVICE):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": info}),))
