//! Self-signed serving certificates for the webhook (`certs` subcommand), made with rcgen.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};

/// A CA and a serving certificate signed by it, PEM encoded.
pub struct CertBundle {
    /// The CA certificate (the webhook configurations' `caBundle`).
    pub ca_cert: String,
    /// The serving certificate.
    pub tls_cert: String,
    /// The serving certificate's private key.
    pub tls_key: String,
}

/// Makes a fresh CA (valid 10 years) and a serving certificate (valid 1 year) for `hosts`,
/// which may be DNS names or IP addresses.
pub fn generate(hosts: &[String]) -> anyhow::Result<CertBundle> {
    anyhow::ensure!(!hosts.is_empty(), "at least one --host is needed");
    let now = OffsetDateTime::now_utc();

    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name = name("persistent-pod-state CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca.not_before = now - Duration::hours(1);
    ca.not_after = now + Duration::days(3650);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;

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
    let cert = serving.signed_by(&key, &ca)?;

    Ok(CertBundle {
        ca_cert: ca.pem(),
        tls_cert: cert.pem(),
        tls_key: key.serialize_pem(),
    })
}

fn name(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

/// Writes `ca.crt`, `tls.crt` and `tls.key` (mode 0600) into `dir`, creating it if needed.
pub fn write(bundle: &CertBundle, dir: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let files = [
        ("ca.crt", &bundle.ca_cert, 0o644),
        ("tls.crt", &bundle.tls_cert, 0o644),
        ("tls.key", &bundle.tls_key, 0o600),
    ];
    for (file, content, mode) in files {
        let path = dir.join(file);
        // Write a sibling and rename it, so a server reading the directory never sees half a file.
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
        let b = generate(&["webhook.svc".into(), "127.0.0.1".into()]).expect("generated");
        for pem in [&b.ca_cert, &b.tls_cert] {
            assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"));
        }
        assert!(b.tls_key.contains("PRIVATE KEY"));
        assert_ne!(b.ca_cert, b.tls_cert);
    }

    #[test]
    fn rejects_no_hosts() {
        assert!(generate(&[]).is_err());
    }
}
