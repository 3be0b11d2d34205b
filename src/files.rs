//! Noticing that a file changed, one way for every file the process re-reads (the serving
//! certificate and key, the custom-workload configuration): a stamp of the file's metadata,
//! following symlinks, so that Kubernetes' symlink swap of a Secret or ConfigMap volume counts.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::SystemTime;

/// Identity of a file's content as far as its metadata tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    modified: Option<SystemTime>,
}

impl FileStamp {
    /// The stamp of the file at `path` now (the target, if it is a symlink).
    pub fn of(path: &Path) -> std::io::Result<Self> {
        let m = std::fs::metadata(path)?;
        Ok(Self {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            modified: m.modified().ok(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_or_rewritten_file_has_another_stamp() {
        let dir = std::env::temp_dir().join(format!("pps-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (a, b, link) = (dir.join("a"), dir.join("b"), dir.join("link"));
        std::fs::write(&a, "one").expect("write");
        std::fs::write(&b, "one").expect("write");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&a, &link).expect("symlink");
        let first = FileStamp::of(&link).expect("stamp");
        assert_eq!(FileStamp::of(&link).expect("stamp"), first, "unchanged");
        // the symlink swap of a Secret volume
        std::fs::remove_file(&link).expect("unlink");
        std::os::unix::fs::symlink(&b, &link).expect("symlink");
        assert_ne!(FileStamp::of(&link).expect("stamp"), first, "other inode");
        std::fs::write(&b, "longer").expect("rewrite");
        assert_ne!(
            FileStamp::of(&b).expect("stamp"),
            FileStamp::of(&a).expect("stamp")
        );
        assert!(FileStamp::of(&dir.join("missing")).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}
