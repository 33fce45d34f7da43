//! `docs/configuration.md` is what the config types render
//! (`proxy_agent::config_reference`): a field added without a doc comment,
//! or a page not regenerated after a change, fails here.

use std::path::Path;

#[test]
fn configuration_page_is_generated_and_current() {
    let page = proxy_agent::config_reference::markdown().unwrap_or_else(|missing| {
        panic!(
            "config fields or enum values without a doc comment (add one in \
             proxy-agent/src/config.rs or the type's module): {missing:?}"
        )
    });
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(proxy_agent::config_reference::PAGE);
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    if on_disk != page {
        let first = on_disk
            .lines()
            .zip(page.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| on_disk.lines().count().min(page.lines().count()));
        panic!(
            "{} is not what the config types render (first difference at line {}: {:?}, \
             rendered {:?}): run `cargo xtask docs` and commit it",
            proxy_agent::config_reference::PAGE,
            first + 1,
            on_disk.lines().nth(first).unwrap_or(""),
            page.lines().nth(first).unwrap_or(""),
        );
    }
}

/// Every field of the file is on the page (the schema follows serde's
/// renames, so these are the names a user writes).
#[test]
fn configuration_page_names_every_field() {
    let page = proxy_agent::config_reference::markdown().unwrap();
    for field in [
        "healthzBindAddress",
        "clusterCIDR",
        "hairpinSnatIP",
        "hairpinSnatIPv6",
        "hostSocketLB",
        "externalIPAllowCIDRs",
        "maxPerCore",
        "tableSize",
        "reverseNat",
        "`round-robin`",
        "`legacy`",
    ] {
        assert!(page.contains(field), "{field} missing from the page");
    }
}
