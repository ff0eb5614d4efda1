"""msgspec (msgpack) encoding of the messages between the frontend and the engine-core process.

Frontend -> core messages are two frames, [kind, payload]; core -> frontend messages are one
frame, an encoded EngineCoreOutputs. The protocol dataclasses are encoded as they are.
"""

from __future__ import annotations

import enum

import msgspec

from tokenmill.protocol import EngineCoreOutputs, EngineRequest, ProfileCommand


class RequestKind(bytes, enum.Enum):
    ADD = b"A"
    """payload: EngineRequest"""
    ABORT = b"X"
    """payload: list of request ids"""
    PROFILE = b"P"
    """payload: ProfileCommand"""
    WAKE = b"W"
    """no payload: take a turn now (replicas that step together: another one got a request)"""


def _enc_hook(obj: object) -> object:
    # Only plain data crosses processes; Python callables (logits_processors) cannot.
    raise TypeError(f"{obj!r} cannot be sent to the engine-core process (only the offline LLM accepts it)")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_request_decoder = msgspec.msgpack.Decoder(EngineRequest)
_abort_decoder = msgspec.msgpack.Decoder(list[str])
_payload_decoders = {RequestKind.ADD: _request_decoder, RequestKind.ABORT: _abort_decoder,
                     RequestKind.PROFILE: msgspec.msgpack.Decoder(ProfileCommand)}
_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)


def encode_add(request: EngineRequest) -> list[bytes]:
    """ValueError for what cannot cross (Python callables, integers past 64 bits): the request's fault."""
    try:
        return [RequestKind.ADD.value, _encoder.encode(request)]
    except (TypeError, OverflowError) as e:
        raise ValueError(str(e)) from e


def encode_abort(request_ids: list[str]) -> list[bytes]:
    return [RequestKind.ABORT.value, _encoder.encode(request_ids)]


def encode_profile(command: ProfileCommand) -> list[bytes]:
    return [RequestKind.PROFILE.value, _encoder.encode(command)]


def encode_wake() -> list[bytes]:
    return [RequestKind.WAKE.value, b""]


def decode_request(frames: list[bytes]) -> tuple[RequestKind, EngineRequest | list[str] | ProfileCommand | None]:
    kind, payload = RequestKind(frames[0]), frames[1]
    return kind, None if kind == RequestKind.WAKE else _payload_decoders[kind].decode(payload)


def encode_outputs(outputs: EngineCoreOutputs) -> bytes:
    return _encoder.encode(outputs)


def decode_outputs(payload: bytes) -> EngineCoreOutputs:
    return _outputs_decoder.decode(payload)
