//! TLS for the webhook: the certificate and key, and the client CA bundle, are re-read when
//! their files change (checked at most once a second, on new connections; the serving pair also
//! every 10 s between them), so a rotated Secret — including Kubernetes' symlink swap of a Secret
//! volume — is used without a restart.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use prometheus_client::metrics::gauge::Gauge;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, ServerConfig, SignatureScheme};

use crate::files::FileStamp;

const RECHECK: Duration = Duration::from_secs(1);

/// The stamps of files as last loaded, and when they were last looked at.
struct Stamps {
    loaded: Vec<FileStamp>,
    checked: Instant,
}

impl Stamps {
    fn new(loaded: Vec<FileStamp>) -> Self {
        Self {
            loaded,
            checked: Instant::now(),
        }
    }

    /// Whether `files` changed since they were loaded: looked at no more than once a
    /// [`RECHECK`]; a file that cannot be read now counts as unchanged (a rotation in progress).
    fn changed(&mut self, files: &[&Path]) -> bool {
        if self.checked.elapsed() < RECHECK {
            return false;
        }
        self.checked = Instant::now();
        files
            .iter()
            .map(|f| FileStamp::of(f))
            .collect::<Result<Vec<_>, _>>()
            .is_ok_and(|now| now != self.loaded)
    }
}

struct Loaded {
    stamps: Stamps,
    /// When the served certificate expires (Unix seconds), if it could be read.
    expires: Option<i64>,
    key: Arc<CertifiedKey>,
}

/// Serves the certificate in `cert`/`key`, reloading them when the files change. A change that
/// does not load (half-written files, a key that does not match) keeps the previous pair.
pub struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    loaded: Mutex<Loaded>,
    /// Set to the served certificate's expiry (Unix seconds) whenever one is loaded.
    expiry: Gauge,
}

impl fmt::Debug for ReloadingCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadingCert")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish()
    }
}

/// When the leaf certificate `der` expires, in Unix seconds.
fn not_after(der: &CertificateDer<'_>) -> Option<i64> {
    x509_parser::parse_x509_certificate(der)
        .ok()
        .map(|(_, c)| c.validity().not_after.timestamp())
}

fn load(
    cert: &Path,
    key: &Path,
    provider: &CryptoProvider,
) -> anyhow::Result<(Vec<FileStamp>, Arc<CertifiedKey>)> {
    let stamps = vec![
        FileStamp::of(cert).with_context(|| format!("reading {}", cert.display()))?,
        FileStamp::of(key).with_context(|| format!("reading {}", key.display()))?,
    ];
    let chain = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("reading {}", cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing {}", cert.display()))?;
    anyhow::ensure!(!chain.is_empty(), "{} holds no certificate", cert.display());
    let private =
        PrivateKeyDer::from_pem_file(key).with_context(|| format!("reading {}", key.display()))?;
    let certified = CertifiedKey::from_der(chain, private, provider)
        .with_context(|| format!("{} does not match {}", key.display(), cert.display()))?;
    Ok((stamps, Arc::new(certified)))
}

impl ReloadingCert {
    /// Loads the pair once; fails if it cannot be used. `expiry` is kept at the served
    /// certificate's expiry (Unix seconds).
    pub fn new(
        cert: PathBuf,
        key: PathBuf,
        provider: Arc<CryptoProvider>,
        expiry: Gauge,
    ) -> anyhow::Result<Self> {
        let (stamps, certified) = load(&cert, &key, &provider)?;
        let expires = certified.cert.first().and_then(not_after);
        expiry.set(expires.unwrap_or_default());
        Ok(Self {
            cert,
            key,
            provider,
            loaded: Mutex::new(Loaded {
                stamps: Stamps::new(stamps),
                expires,
                key: certified,
            }),
            expiry,
        })
    }

    /// When the certificate served now expires (Unix seconds), if it could be read.
    pub fn expires(&self) -> Option<i64> {
        crate::sync::lock(&self.loaded).expires
    }

    /// The pair to serve now, reloaded first if the files changed.
    pub fn current(&self) -> Arc<CertifiedKey> {
        let mut loaded = crate::sync::lock(&self.loaded);
        if loaded.stamps.changed(&[&self.cert, &self.key]) {
            match load(&self.cert, &self.key, &self.provider) {
                Ok((stamps, key)) => {
                    tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                    loaded.stamps.loaded = stamps;
                    loaded.expires = key.cert.first().and_then(not_after);
                    self.expiry.set(loaded.expires.unwrap_or_default());
                    loaded.key = key;
                }
                Err(error) => {
                    tracing::warn!(%error, "new serving certificate not usable yet; keeping the previous one")
                }
            }
        }
        loaded.key.clone()
    }
}

/// How often the served certificate's files are looked at between handshakes.
const LOOKED_AT_EVERY: Duration = Duration::from_secs(10);

/// Looks at `cert`'s files every `every` from a task of the current runtime (if any), until
/// `cert` is dropped: a renewed pair is loaded, and its expiry shown, though no handshake comes
/// (the API server keeps its connections for minutes, and an alert on the expiry would fire on
/// a certificate renewed long ago).
fn look_between_handshakes(cert: &Arc<ReloadingCert>, every: Duration) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let cert = Arc::downgrade(cert);
    runtime.spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Some(cert) = cert.upgrade() else {
                return;
            };
            cert.current();
        }
    });
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// The CAs of the bundle at `path`, as a verifier that asks for a client certificate and
/// accepts a connection without one (the admission routes then answer 403).
fn load_client_ca(
    path: &Path,
    provider: &Arc<CryptoProvider>,
) -> anyhow::Result<(FileStamp, Arc<dyn ClientCertVerifier>)> {
    let stamp = FileStamp::of(path).with_context(|| format!("reading {}", path.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path)
        .with_context(|| format!("reading {}", path.display()))?
    {
        roots
            .add(cert.with_context(|| format!("parsing {}", path.display()))?)
            .with_context(|| format!("a CA of {}", path.display()))?;
    }
    anyhow::ensure!(!roots.is_empty(), "{} holds no certificate", path.display());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .allow_unauthenticated()
    .build()
    .context("client certificate verifier")?;
    Ok((stamp, verifier))
}

struct LoadedCa {
    stamps: Stamps,
    verifier: Arc<dyn ClientCertVerifier>,
}

/// Verifies client certificates against the CA bundle at `path`, re-read when the file changes
/// (looked at no more than once a second, on handshakes presenting a certificate), so that a
/// rotated CA is trusted without a restart. A change that does not load (a half-written or
/// empty bundle) keeps the previous CAs. No CA names are hinted to clients: the bundle may
/// change between hint and certificate, and a client told none sends the certificate it has.
pub struct ReloadingClientCa {
    path: PathBuf,
    provider: Arc<CryptoProvider>,
    loaded: Mutex<LoadedCa>,
}

impl fmt::Debug for ReloadingClientCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadingClientCa")
            .field("path", &self.path)
            .finish()
    }
}

impl ReloadingClientCa {
    /// Loads the bundle once; fails if it holds no usable CA.
    pub fn new(path: PathBuf, provider: Arc<CryptoProvider>) -> anyhow::Result<Self> {
        let (stamp, verifier) = load_client_ca(&path, &provider)?;
        Ok(Self {
            path,
            provider,
            loaded: Mutex::new(LoadedCa {
                stamps: Stamps::new(vec![stamp]),
                verifier,
            }),
        })
    }

    /// The verifier of the CAs trusted now, reloaded first if the file changed.
    fn current(&self) -> Arc<dyn ClientCertVerifier> {
        let mut loaded = crate::sync::lock(&self.loaded);
        if loaded.stamps.changed(&[&self.path]) {
            match load_client_ca(&self.path, &self.provider) {
                Ok((stamp, verifier)) => {
                    tracing::info!(client_ca = %self.path.display(), "client CA bundle reloaded");
                    loaded.stamps.loaded = vec![stamp];
                    loaded.verifier = verifier;
                }
                Err(error) => {
                    tracing::warn!(%error, "new client CA bundle not usable yet; keeping the previous one")
                }
            }
        }
        loaded.verifier.clone()
    }
}

impl ClientCertVerifier for ReloadingClientCa {
    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.current()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A rustls server configuration (ring provider, TLS 1.2 and 1.3, h2 and http/1.1) serving the
/// reloading certificate at `cert`/`key` (its expiry kept in `expiry`). With `client_ca`, a
/// client certificate is verified against the CAs of that bundle, re-read when it changes
/// ([`ReloadingClientCa`]), on every connection (no session is resumed): a connection
/// presenting an invalid one is refused; one presenting
/// none is accepted, and the admission routes then answer 403 (see `webhook::refusal`), while
/// `/convert` stays open (the API server presents admission client certificates from its
/// AdmissionConfiguration, but none for CRD conversion).
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    expiry: Gauge,
) -> anyhow::Result<Arc<ServerConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let resolver = Arc::new(ReloadingCert::new(
        cert.to_owned(),
        key.to_owned(),
        provider.clone(),
        expiry,
    )?);
    look_between_handshakes(&resolver, LOOKED_AT_EVERY);
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => builder.with_client_cert_verifier(Arc::new(ReloadingClientCa::new(
            path.to_owned(),
            provider,
        )?)),
    };
    let mut config = builder.with_cert_resolver(resolver);
    if client_ca.is_some() {
        // A resumed session keeps the client certificate verified when it began, whatever CAs
        // are trusted now: every connection verifies its certificate afresh (the API server
        // keeps its connections, so full handshakes are rare).
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
    }
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::certs;

    /// A client CA (its PEM, to configure `--client-ca`) and a client certificate it signed, with
    /// its key (both PEM).
    pub(crate) fn client_identity() -> (String, String, String) {
        use rcgen::{
            BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa,
            KeyPair,
        };
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().expect("key")).expect("ca");
        let mut client =
            CertificateParams::new(vec!["kube-apiserver".to_string()]).expect("params");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().expect("key");
        let cert = client.signed_by(&key, &ca).expect("client cert");
        (ca.pem(), cert.pem(), key.serialize_pem())
    }

    /// Replaces the file at `path` with one holding `content`, as a Secret volume's update does
    /// (another file put in its place), so that it looks changed whatever the clock's grain.
    fn replace(path: &Path, content: &str) {
        let next = path.with_extension("next");
        std::fs::write(&next, content).expect("write");
        std::fs::rename(&next, path).expect("rename");
    }

    fn der(pem: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(pem.as_bytes()).expect("pem")
    }

    #[test]
    fn a_rotated_client_ca_is_trusted_and_an_unusable_one_keeps_the_previous() {
        let dir = std::env::temp_dir().join(format!("pps-client-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("ca.crt");
        let (old_ca, old_client, _) = client_identity();
        let (new_ca, new_client, _) = client_identity();
        std::fs::write(&path, &old_ca).expect("write");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let ca = ReloadingClientCa::new(path.clone(), provider).expect("loads");
        let now = UnixTime::now();
        let verify = |client: &str| ca.verify_client_cert(&der(client), &[], now).is_ok();
        assert!(verify(&old_client));
        assert!(!verify(&new_client), "not signed by the CA trusted now");
        assert!(ca.root_hint_subjects().is_empty(), "no stale hints");

        replace(&path, &new_ca);
        assert!(verify(&old_client), "looked at no more than once a second");
        ca.loaded.lock().expect("lock").stamps.checked -= RECHECK;
        assert!(verify(&new_client), "the rotated CA is trusted");
        assert!(!verify(&old_client), "the old one no longer");

        replace(&path, "garbage");
        ca.loaded.lock().expect("lock").stamps.checked -= RECHECK;
        assert!(
            verify(&new_client),
            "an unusable bundle keeps the previous CAs"
        );
        replace(&path, "");
        ca.loaded.lock().expect("lock").stamps.checked -= RECHECK;
        assert!(verify(&new_client), "so does an empty one");

        let missing = ReloadingClientCa::new(
            dir.join("missing.crt"),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .expect_err("fails");
        assert!(
            format!("{missing:#}").contains("missing.crt"),
            "{missing:#}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Through the served configuration: a handshake presenting a certificate of a CA the
    /// bundle was rotated to succeeds (within a few seconds of the rotation) and is verified.
    #[tokio::test]
    async fn the_served_configuration_trusts_a_rotated_client_ca() {
        let dir = std::env::temp_dir().join(format!("pps-client-ca-tls-{}", std::process::id()));
        let bundle = certs::generate(&["localhost".into()], None).expect("certs");
        certs::write(&bundle, &dir).expect("write");
        let path = dir.join("client-ca.crt");
        let (old_ca, old_cert, old_key) = client_identity();
        let (new_ca, new_cert, new_key) = client_identity();
        std::fs::write(&path, &old_ca).expect("write");
        let server = tokio_rustls::TlsAcceptor::from(
            server_config(
                &dir.join("tls.crt"),
                &dir.join("tls.key"),
                Some(&path),
                Gauge::default(),
            )
            .expect("config"),
        );
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der(&bundle.ca_cert)).expect("root");
        // A client of each CA, each keeping what it is given to resume its sessions.
        let client = |cert: &str, key: &str| {
            let config = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots.clone())
            .with_client_auth_cert(
                vec![der(cert)],
                PrivateKeyDer::from_pem_slice(key.as_bytes()).expect("key"),
            )
            .expect("client auth");
            tokio_rustls::TlsConnector::from(Arc::new(config))
        };
        let (old, new) = (client(&old_cert, &old_key), client(&new_cert, &new_key));
        // Whether a handshake of `client` ends with the server holding its certificate,
        // verified; the server then sends a byte, which the client reads (and with it what
        // the server sent after the handshake: a session ticket, were there one).
        let handshake = |client: &tokio_rustls::TlsConnector| {
            let (server, client) = (server.clone(), client.clone());
            async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let (a, b) = tokio::io::duplex(64 << 10);
                let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
                let (accepted, connected) = tokio::join!(server.accept(a), client.connect(name, b));
                let (Ok(mut accepted), Ok(mut connected)) = (accepted, connected) else {
                    return false;
                };
                let verified = accepted.get_ref().1.peer_certificates().is_some();
                let mut byte = [0u8];
                let (sent, read) = tokio::join!(
                    async { accepted.write_all(b"x").await.and(accepted.flush().await) },
                    connected.read_exact(&mut byte)
                );
                sent.is_ok() && read.is_ok() && verified
            }
        };
        assert!(handshake(&old).await);
        assert!(handshake(&old).await, "again, as a client resuming would");
        assert!(!handshake(&new).await, "not trusted yet");
        replace(&path, &new_ca);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !handshake(&new).await {
            assert!(
                Instant::now() < deadline,
                "the rotated CA was never trusted"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            !handshake(&old).await,
            "the old CA no longer, not even by resuming a session it verified"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A serving pair written into `name` under the temporary directory, loaded: the directory,
    /// the certificate served, and its expiry gauge.
    fn loaded_pair(name: &str) -> (PathBuf, ReloadingCert, Gauge) {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        certs::write(
            &certs::generate(&["a.example".into()], None).expect("gen"),
            &dir,
        )
        .expect("write");
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let expiry = Gauge::default();
        let r = ReloadingCert::new(
            dir.join("tls.crt"),
            dir.join("tls.key"),
            provider,
            expiry.clone(),
        )
        .expect("loads");
        (dir, r, expiry)
    }

    /// Writes into `dir` a self-signed pair expiring on 2031-01-02 (1,925,078,400).
    fn write_pair_expiring_2031(dir: &Path) {
        let mut params = rcgen::CertificateParams::new(vec!["c.example".into()]).expect("params");
        params.not_after = rcgen::date_time_ymd(2031, 1, 2);
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("cert");
        std::fs::write(dir.join("tls.crt"), cert.pem()).expect("write");
        std::fs::write(dir.join("tls.key"), key.serialize_pem()).expect("write");
    }

    #[test]
    fn reloads_changed_files_and_keeps_the_old_pair_on_garbage() {
        let (dir, r, expiry) = loaded_pair("pps-tls");
        let first = r.current().cert[0].clone();
        // certs::generate issues for 365 days.
        let year = time::OffsetDateTime::now_utc().unix_timestamp() + 365 * 86_400;
        assert!((expiry.get() - year).abs() < 86_400, "{}", expiry.get());
        assert_eq!(r.expires(), Some(expiry.get()));

        certs::write(
            &certs::generate(&["b.example".into()], None).expect("gen"),
            &dir,
        )
        .expect("write");
        r.loaded.lock().expect("lock").stamps.checked -= RECHECK;
        let second = r.current().cert[0].clone();
        assert_ne!(first, second, "new pair served");

        // A pair expiring on 2031-01-02: the gauge follows the certificate served.
        write_pair_expiring_2031(&dir);
        r.loaded.lock().expect("lock").stamps.checked -= RECHECK;
        let third = r.current().cert[0].clone();
        assert_ne!(third, second, "new pair served");
        assert_eq!(expiry.get(), 1_925_078_400);

        std::fs::write(dir.join("tls.crt"), "garbage").expect("write");
        r.loaded.lock().expect("lock").stamps.checked -= RECHECK;
        assert_eq!(r.current().cert[0], third, "previous pair kept");
        assert_eq!(expiry.get(), 1_925_078_400, "and its expiry");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A pair renewed while no handshake comes is loaded all the same, and its expiry shown.
    #[tokio::test]
    async fn a_renewed_pair_is_loaded_and_its_expiry_shown_without_a_handshake() {
        let (dir, r, expiry) = loaded_pair("pps-tls-idle");
        let r = Arc::new(r);
        look_between_handshakes(&r, Duration::from_millis(10));
        write_pair_expiring_2031(&dir);
        r.loaded.lock().expect("lock").stamps.checked -= RECHECK;
        let deadline = Instant::now() + Duration::from_secs(10);
        while expiry.get() != 1_925_078_400 {
            assert!(Instant::now() < deadline, "still {}", expiry.get());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(r.expires(), Some(1_925_078_400));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn unusable_files_are_a_clear_error() {
        let err = server_config(
            Path::new("/nonexistent/tls.crt"),
            Path::new("/nonexistent/tls.key"),
            None,
            Gauge::default(),
        )
        .expect_err("fails");
        assert!(
            format!("{err:#}").contains("/nonexistent/tls.crt"),
            "{err:#}"
        );
    }
}
