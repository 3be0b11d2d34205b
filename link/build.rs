//! Cargo's build script for the package: tells Cargo to build again when the link order
//! changes. The linker `.cargo/config.toml` names (`link/hot-first.sh`) reads these files,
//! which Cargo does not otherwise know of, so a change to them alone would leave the
//! binaries linked in the old order.

fn main() {
    for file in ["link/hot-functions.txt", "link/hot-first.sh", "link/lib.sh"] {
        println!("cargo::rerun-if-changed={file}");
    }
}
