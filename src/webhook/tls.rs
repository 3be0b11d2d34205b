//! TLS for the webhook: the certificate and key are re-read when their files change (checked at
//! most once a second, on new connections), so a rotated Secret — including Kubernetes'
//! symlink swap of a Secret volume — is used without a restart.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use prometheus_client::metrics::gauge::Gauge;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::files::FileStamp;

const RECHECK: Duration = Duration::from_secs(1);

struct Loaded {
    stamps: (FileStamp, FileStamp),
    /// When the served certificate expires (Unix seconds), if it could be read.
    expires: Option<i64>,
    key: Arc<CertifiedKey>,
    checked: Instant,
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
) -> anyhow::Result<((FileStamp, FileStamp), Arc<CertifiedKey>)> {
    let stamps = (
        FileStamp::of(cert).with_context(|| format!("reading {}", cert.display()))?,
        FileStamp::of(key).with_context(|| format!("reading {}", key.display()))?,
    );
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
                stamps,
                expires,
                key: certified,
                checked: Instant::now(),
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
        if loaded.checked.elapsed() >= RECHECK {
            loaded.checked = Instant::now();
            let now = (FileStamp::of(&self.cert), FileStamp::of(&self.key));
            let changed = match now {
                (Ok(c), Ok(k)) => (c, k) != loaded.stamps,
                _ => false,
            };
            if changed {
                match load(&self.cert, &self.key, &self.provider) {
                    Ok((stamps, key)) => {
                        tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                        loaded.stamps = stamps;
                        loaded.expires = key.cert.first().and_then(not_after);
                        self.expiry.set(loaded.expires.unwrap_or_default());
                        loaded.key = key;
                    }
                    Err(error) => {
                        tracing::warn!(%error, "new serving certificate not usable yet; keeping the previous one")
                    }
                }
            }
        }
        loaded.key.clone()
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// A rustls server configuration (ring provider, TLS 1.2 and 1.3, h2 and http/1.1) serving the
/// reloading certificate at `cert`/`key` (its expiry kept in `expiry`). With `client_ca`, a client certificate is verified
/// against its CAs: a connection presenting an invalid one is refused; one presenting none is
/// accepted, and the admission routes then answer 403 (see `webhook::refusal`),
/// while `/convert` stays open (the API server presents admission client certificates from its
/// AdmissionConfiguration, but none for CRD conversion).
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    expiry: Gauge,
) -> anyhow::Result<Arc<ServerConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let resolver = ReloadingCert::new(cert.to_owned(), key.to_owned(), provider.clone(), expiry)?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
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
                provider,
            )
            .allow_unauthenticated()
            .build()
            .context("client certificate verifier")?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_cert_resolver(Arc::new(resolver));
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs;

    #[test]
    fn reloads_changed_files_and_keeps_the_old_pair_on_garbage() {
        let dir = std::env::temp_dir().join(format!("pps-tls-{}", std::process::id()));
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
        r.loaded.lock().expect("lock").checked -= RECHECK;
        let second = r.current().cert[0].clone();
        assert_ne!(first, second, "new pair served");

        // A pair expiring on 2031-01-02: the gauge follows the certificate served.
        let mut params = rcgen::CertificateParams::new(vec!["c.example".into()]).expect("params");
        params.not_after = rcgen::date_time_ymd(2031, 1, 2);
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("cert");
        std::fs::write(dir.join("tls.crt"), cert.pem()).expect("write");
        std::fs::write(dir.join("tls.key"), key.serialize_pem()).expect("write");
        r.loaded.lock().expect("lock").checked -= RECHECK;
        let third = r.current().cert[0].clone();
        assert_ne!(third, second, "new pair served");
        assert_eq!(expiry.get(), 1_925_078_400);

        std::fs::write(dir.join("tls.crt"), "garbage").expect("write");
        r.loaded.lock().expect("lock").checked -= RECHECK;
        assert_eq!(r.current().cert[0], third, "previous pair kept");
        assert_eq!(expiry.get(), 1_925_078_400, "and its expiry");
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
