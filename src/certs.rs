//! Serving certificates for the webhook (`certs` subcommand), made with rcgen: a CA and a
//! serving certificate signed by it. When the output directory already holds a CA (`ca.crt`
//! and `ca.key`), it is kept and only the serving certificate is renewed, so a rotation needs
//! no change to the caBundle that API servers trust.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

/// A CA and a serving certificate signed by it, PEM encoded.
pub struct CertBundle {
    /// The CA certificate (the webhook configurations' `caBundle`).
    pub ca_cert: String,
    /// The CA's private key (kept to renew the serving certificate under the same CA).
    pub ca_key: String,
    /// The serving certificate.
    pub tls_cert: String,
    /// The serving certificate's private key.
    pub tls_key: String,
}

/// An existing CA, PEM encoded.
pub struct ExistingCa {
    /// The CA certificate.
    pub cert: String,
    /// Its private key.
    pub key: String,
}

fn name(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

/// Makes a serving certificate (valid 1 year) for `hosts` (DNS names or IP addresses), signed
/// by `ca` if given, else by a fresh CA (valid 10 years).
pub fn generate(hosts: &[String], ca: Option<&ExistingCa>) -> anyhow::Result<CertBundle> {
    anyhow::ensure!(!hosts.is_empty(), "at least one --host is needed");
    let now = OffsetDateTime::now_utc();
    let (issuer, ca_cert, ca_key) = match ca {
        Some(existing) => {
            let key =
                KeyPair::from_pem(&existing.key).context("ca.key is not a usable private key")?;
            let issuer = Issuer::from_ca_cert_pem(&existing.cert, key)
                .context("ca.crt is not a usable CA certificate")?;
            (issuer, existing.cert.clone(), existing.key.clone())
        }
        None => {
            let mut params = CertificateParams::new(Vec::<String>::new())?;
            params.distinguished_name = name("persistent-pod-state CA");
            params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
            params.key_usages = vec![
                KeyUsagePurpose::KeyCertSign,
                KeyUsagePurpose::CrlSign,
                KeyUsagePurpose::DigitalSignature,
            ];
            params.not_before = now - Duration::hours(1);
            params.not_after = now + Duration::days(3650);
            let key = KeyPair::generate()?;
            let key_pem = key.serialize_pem();
            let certified = CertifiedIssuer::self_signed(params.clone(), key)?;
            let cert_pem = certified.pem();
            let issuer = Issuer::new(params, KeyPair::from_pem(&key_pem)?);
            (issuer, cert_pem, key_pem)
        }
    };

    let mut serving = CertificateParams::new(hosts.to_vec())
        .with_context(|| format!("invalid --host in {hosts:?}"))?;
    serving.distinguished_name = name(&hosts[0]);
    serving.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    serving.not_before = now - Duration::hours(1);
    serving.not_after = now + Duration::days(365);
    let key = KeyPair::generate()?;
    let cert = serving.signed_by(&key, &issuer)?;

    Ok(CertBundle {
        ca_cert,
        ca_key,
        tls_cert: cert.pem(),
        tls_key: key.serialize_pem(),
    })
}

/// The CA kept in `dir` (`ca.crt` and `ca.key`), if both are there; an error if only one is
/// (a new CA would overwrite it, and every client trusting the old one would fail).
pub fn existing_ca(dir: &Path) -> anyhow::Result<Option<ExistingCa>> {
    let (cert, key) = (dir.join("ca.crt"), dir.join("ca.key"));
    match (cert.try_exists()?, key.try_exists()?) {
        (false, false) => return Ok(None),
        (true, true) => {}
        (there, _) => {
            let (there, missing) = if there { (&cert, &key) } else { (&key, &cert) };
            anyhow::bail!(
                "{} is there and {} is not: restore it, or move {} away to make a new CA (every client trusting the old one must then be given the new ca.crt)",
                there.display(),
                missing.display(),
                there.display()
            );
        }
    }
    Ok(Some(ExistingCa {
        cert: fs::read_to_string(&cert).with_context(|| format!("reading {}", cert.display()))?,
        key: fs::read_to_string(&key).with_context(|| format!("reading {}", key.display()))?,
    }))
}

/// Writes `ca.crt`, `ca.key` (0600), `tls.crt` and `tls.key` (0600) into `dir`, creating it if
/// needed. Each file is written beside and renamed into place, so a reader never sees half.
pub fn write(bundle: &CertBundle, dir: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let files = [
        ("ca.crt", &bundle.ca_cert, 0o644),
        ("ca.key", &bundle.ca_key, 0o600),
        ("tls.crt", &bundle.tls_cert, 0o644),
        ("tls.key", &bundle.tls_key, 0o600),
    ];
    for (file, content, mode) in files {
        let path = dir.join(file);
        let tmp = dir.join(format!(".{file}.tmp"));
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)
            .with_context(|| format!("writing {}", tmp.display()))?;
        f.write_all(content.as_bytes())?;
        f.sync_all()?;
        fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_a_chain_for_names_and_ips() {
        let b = generate(&["webhook.svc".into(), "127.0.0.1".into()], None).expect("generated");
        for pem in [&b.ca_cert, &b.tls_cert] {
            assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"));
        }
        assert!(b.tls_key.contains("PRIVATE KEY") && b.ca_key.contains("PRIVATE KEY"));
        assert_ne!(b.ca_cert, b.tls_cert);
    }

    #[test]
    fn renewal_keeps_the_ca() {
        let first = generate(&["a.svc".into()], None).expect("first");
        let ca = ExistingCa {
            cert: first.ca_cert.clone(),
            key: first.ca_key.clone(),
        };
        let second = generate(&["a.svc".into()], Some(&ca)).expect("renewed");
        assert_eq!(second.ca_cert, first.ca_cert);
        assert_ne!(second.tls_cert, first.tls_cert);
        let garbage = ExistingCa {
            cert: "x".into(),
            key: "y".into(),
        };
        assert!(generate(&["a.svc".into()], Some(&garbage)).is_err());
    }

    #[test]
    fn half_a_ca_is_refused_not_replaced() {
        let dir = std::env::temp_dir().join(format!("pps-half-ca-{}", std::process::id()));
        let bundle = generate(&["a.svc".into()], None).expect("generated");
        write(&bundle, &dir).expect("written");
        assert!(existing_ca(&dir).expect("both there").is_some());
        fs::remove_file(dir.join("ca.key")).expect("removed");
        let error = existing_ca(&dir).err().map(|e| e.to_string());
        let error = error.expect("half a CA is an error");
        assert!(error.contains("ca.crt is there and"), "{error}");
        fs::remove_file(dir.join("ca.crt")).expect("removed");
        assert!(existing_ca(&dir).expect("none there").is_none());
        fs::write(dir.join("ca.key"), &bundle.ca_key).expect("written");
        let error = existing_ca(&dir).err().map(|e| e.to_string());
        let error = error.expect("half a CA is an error");
        assert!(error.contains("ca.key is there and"), "{error}");
        fs::remove_dir_all(&dir).expect("cleaned");
    }

    #[test]
    fn rejects_no_hosts() {
        assert!(generate(&[], None).is_err());
    }
}
