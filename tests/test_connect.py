"""Connections like the ``temporal`` CLI's (the SDK's ``envconfig``): TLS, mTLS
and API keys for the worker and every CLI command.

The bundled dev server speaks no TLS, so a real TLS front end stands in for
a secured cluster: a TLS-terminating proxy on loopback (ALPN ``h2``, a
self-signed CA made here, optionally requiring client certificates) that
forwards to the session's dev server. Real connections, real handshakes.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from temporalio.client import Client
from temporalio.service import TLSConfig

from stopline.core.errors import ConfigError
from stopline.settings import load_settings
from stopline.worker.runtime import connect, connect_config
from tests._worker_proc import server_address


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key: object, issuer: tuple[x509.Name, object] | None, *, ca: bool = False,
          server: bool = False) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = issuer or (name, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())  # type: ignore[attr-defined]
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())  # type: ignore[arg-type]


def _pem(obj: object) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server certificate for localhost, and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    ca_key = _key()
    ca = _cert("stopline test CA", ca_key, None, ca=True)
    issuer = (ca.subject, ca_key)
    files = {}
    for name, cert_key, cert in (
        ("ca", ca_key, ca),
        ("server", (k := _key()), _cert("localhost", k, issuer, server=True)),
        ("client", (c := _key()), _cert("stopline-worker", c, issuer)),
    ):
        (d / f"{name}.pem").write_bytes(_pem(cert))
        (d / f"{name}.key").write_bytes(_pem(cert_key))
        files[name] = d / f"{name}.pem"
        files[f"{name}_key"] = d / f"{name}.key"
    return files


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError, ssl.SSLError):
        pass
    finally:
        writer.close()


@pytest_asyncio.fixture
async def tls_front(client: Client, pki: dict[str, Path], request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A TLS-terminating proxy to the dev server; ``mtls`` marker: client certs required."""
    host, port = server_address(client).rsplit(":", 1)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(pki["server"], pki["server_key"])
    ctx.set_alpn_protocols(["h2"])
    if request.node.get_closest_marker("mtls"):
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(pki["ca"])

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    addr = server.sockets[0].getsockname()
    try:
        yield f"127.0.0.1:{addr[1]}"
    finally:
        server.close()


def _env(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for var in [v for v in os.environ if v.startswith("TEMPORAL_")]:
        monkeypatch.delenv(var)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


# ------------------------------------------------------------ profiles


def test_api_key_and_mtls_profiles_reach_the_connect_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pki: dict[str, Path]
) -> None:
    config = tmp_path / "temporal.toml"
    config.write_text(f"""
[profile.default]
address = "my-ns.a1b2c.tmprl.cloud:7233"
namespace = "my-ns.a1b2c"
api_key = "key-from-profile"

[profile.mtls]
address = "temporal.internal:7233"
namespace = "agents"
[profile.mtls.tls]
client_cert_path = "{pki['client']}"
client_key_path = "{pki['client_key']}"
server_ca_cert_path = "{pki['ca']}"
server_name = "temporal.internal"
""")
    _env(monkeypatch, TEMPORAL_CONFIG_FILE=str(config))
    cloud = connect_config(load_settings())
    assert cloud["target_host"] == "my-ns.a1b2c.tmprl.cloud:7233"
    assert cloud["namespace"] == "my-ns.a1b2c"
    assert cloud["api_key"] == "key-from-profile" and cloud["tls"] is True

    monkeypatch.setenv("TEMPORAL_PROFILE", "mtls")
    mtls = connect_config(load_settings())
    tls = mtls["tls"]
    assert isinstance(tls, TLSConfig) and mtls["namespace"] == "agents"
    assert tls.client_cert == pki["client"].read_bytes()
    assert tls.client_private_key == pki["client_key"].read_bytes()
    assert tls.server_root_ca_cert == pki["ca"].read_bytes() and tls.domain == "temporal.internal"

    # the environment overrides the file, as in the temporal CLI
    monkeypatch.setenv("TEMPORAL_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("TEMPORAL_API_KEY", "key-from-env")
    monkeypatch.delenv("TEMPORAL_PROFILE")
    over = connect_config(load_settings())
    assert over["target_host"] == "127.0.0.1:1" and over["api_key"] == "key-from-env"


def test_no_address_anywhere_is_a_clear_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _env(monkeypatch, TEMPORAL_CONFIG_FILE=str(tmp_path / "absent.toml"))
    with pytest.raises(ConfigError, match="no Temporal address"):
        connect_config(load_settings())


# ---------------------------------------------------------- real TLS


async def test_the_worker_client_connects_over_tls(
    tls_front: str, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _env(monkeypatch, TEMPORAL_ADDRESS=tls_front,
         TEMPORAL_TLS_SERVER_CA_CERT_PATH=str(pki["ca"]), TEMPORAL_TLS_SERVER_NAME="localhost")
    client = await connect(load_settings())
    assert await client.count_workflows("WorkflowType = 'AgentTask'") is not None

    # and without trusting the CA the handshake fails: TLS was really in use
    _env(monkeypatch, TEMPORAL_ADDRESS=tls_front, TEMPORAL_TLS="true")
    with pytest.raises(Exception):
        await asyncio.wait_for(connect(load_settings()), 20)


@pytest.mark.mtls
async def test_mtls_needs_the_client_certificate_and_the_cli_uses_it(
    tls_front: str, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _env(monkeypatch, TEMPORAL_ADDRESS=tls_front,
         TEMPORAL_TLS_SERVER_CA_CERT_PATH=str(pki["ca"]), TEMPORAL_TLS_SERVER_NAME="localhost")
    with pytest.raises(Exception):
        client = await asyncio.wait_for(connect(load_settings()), 20)
        await client.count_workflows()
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_CERT_PATH", str(pki["client"]))
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_KEY_PATH", str(pki["client_key"]))
    client = await connect(load_settings())
    await client.count_workflows()

    env = {k: v for k, v in os.environ.items() if not k.startswith("STOPLINE_")}
    env["STOPLINE_HOME"] = str(tmp_path / "home")
    res = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "stopline.cli", "list"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
