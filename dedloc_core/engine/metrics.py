"""Per-peer training metrics published in the DHT under ``{run_id}_metrics``.

Each peer writes one record under its own RSA public key (hivemind's ``[owner:...]`` subkeys with
``RSASignatureValidator``), so no peer can write another's numbers. The worker signs with its
libp2p identity key (``use_identity_key``), so the owner key also proves the record's ``peer_id``:
``fetch`` drops a record whose ``peer_id`` is not the one of the key that signed it. A plain
hivemind client reads the records with the validators from ``validators(run_id)``; the backbone
records them as the learning curve and per-peer contributions (``swarmview``).
"""

from __future__ import annotations

import hashlib
import logging
import os

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator as _Signer
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from pydantic.v1 import BaseModel, StrictFloat, confloat, conint, constr

logger = logging.getLogger(__name__)

EXPIRATION = 600.0


class PeerMetrics(BaseModel):
    peer_id: constr(max_length=128)
    step: conint(ge=0)
    loss: confloat(ge=0.0, le=1000000.0) | None
    samples: conint(ge=0)
    samples_per_second: confloat(ge=0.0)
    compute_seconds: confloat(ge=0.0)
    time: StrictFloat
    display_name: constr(max_length=64) = ""


class MetricsSchema(BaseModel):
    metrics: dict[BytesWithPublicKey, PeerMetrics | None]


def validators(run_id: str) -> list:
    return [SchemaValidator(MetricsSchema, prefix=run_id), RSASignatureValidator()]


def load_identity_key(identity_path: str) -> RSAPrivateKey:
    """The RSA key of a libp2p identity file as hivemind writes it (created here if missing)."""
    if not os.path.isfile(identity_path):
        P2P.generate_identity(identity_path)
    with open(identity_path, "rb") as f:
        proto = crypto_pb2.PrivateKey.FromString(f.read())
    if proto.key_type != crypto_pb2.KeyType.RSA:
        raise ValueError(f"{identity_path} holds no RSA key")
    key = RSAPrivateKey.__new__(RSAPrivateKey)  # hivemind has no constructor from bytes
    key._private_key = serialization.load_der_private_key(proto.data, password=None)
    return key


def use_identity_key(identity_path: str) -> None:
    """Make the identity's key this process's signing key (hivemind's ``RSAPrivateKey.process_wide``).

    Call before building the DHT's validators and the Optimizer: a DHT keeps only one
    ``RSASignatureValidator`` (``merge_with``), so every record of this process (progress, metrics)
    is then signed by the key that also names the peer."""
    RSAPrivateKey._process_wide_key = load_identity_key(identity_path)


def peer_id_of(owner: bytes) -> str:
    """The libp2p peer id of the RSA key in an ``[owner:...]`` subkey (as ``PeerID.from_identity``)."""
    ssh = _Signer._PUBLIC_KEY_RE.findall(owner)
    if len(ssh) != 1:
        raise ValueError("not an owner subkey")
    der = RSAPublicKey.from_bytes(ssh[0])._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo)
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(proto).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def add_validators(dht: DHT, run_id: str, private_key: RSAPrivateKey | None = None) -> bytes:
    """Register the validators on ``dht``; return the signing public key (the record's subkey).

    Without ``private_key``, the process-wide key (see ``use_identity_key``)."""
    signer = RSASignatureValidator(private_key)
    dht.add_validators([SchemaValidator(MetricsSchema, prefix=run_id), signer])
    return signer.local_public_key


def publish(dht: DHT, run_id: str, public_key: bytes, metrics: PeerMetrics) -> None:
    dht.store(
        key=f"{run_id}_metrics",
        subkey=public_key,
        value=metrics.dict(),
        expiration_time=get_dht_time() + EXPIRATION,
        return_future=True,
    )


def fetch(dht: DHT, run_id: str) -> list[PeerMetrics]:
    """The latest valid record of every peer. The DHT drops records signed by another key than their
    subkey's; here we drop malformed ones and those whose ``peer_id`` is not the signer's."""
    found = dht.get(f"{run_id}_metrics", latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    out = []
    for owner, entry in found.value.items():
        try:
            record = PeerMetrics.parse_obj(entry.value)
            signer = peer_id_of(owner)
        except Exception:  # skip records that do not parse
            continue
        if record.peer_id != signer:
            logger.warning("Ignoring metrics that claim peer %s but are signed by %s", record.peer_id, signer)
            continue
        out.append(record)
    return out
