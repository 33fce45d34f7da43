//! `aya::Pod` for every map key and value (the `user` feature): the agent
//! reads and writes them as plain bytes.

use super::*;
// SAFETY: plain `#[repr(C)]` structs of integers, padded by hand, no
// implicit padding (checked by the size asserts beside each type).
// SAFETY: as above.
unsafe impl aya::Pod for Svc4Key {}
// SAFETY: as above.
unsafe impl aya::Pod for SvcValue {}
// SAFETY: as above.
unsafe impl aya::Pod for Backend4 {}
// SAFETY: as above.
unsafe impl aya::Pod for RevNat4 {}
// SAFETY: as above.
unsafe impl aya::Pod for Ct4Key {}
// SAFETY: as above.
unsafe impl aya::Pod for Ct4Value {}
// SAFETY: as above.
unsafe impl aya::Pod for Config {}
// SAFETY: as above.
unsafe impl aya::Pod for Iface {}
// SAFETY: as above.
unsafe impl aya::Pod for Affinity4Key {}
// SAFETY: as above.
unsafe impl aya::Pod for AffinityValue {}
// SAFETY: as above.
unsafe impl aya::Pod for Frag4Key {}
// SAFETY: as above.
unsafe impl aya::Pod for FragPorts {}
// SAFETY: as above.
unsafe impl aya::Pod for SourceRange4 {}
// SAFETY: as above.
unsafe impl aya::Pod for Traffic {}
// SAFETY: as above.
unsafe impl aya::Pod for SockRevNat4Key {}
// SAFETY: as above.
unsafe impl aya::Pod for SockRevNat4Value {}
// SAFETY: as above.
unsafe impl aya::Pod for lb::MaglevKey {}
// SAFETY: as above.
unsafe impl aya::Pod for lb::MaglevChunk {}
// SAFETY: as above.
unsafe impl aya::Pod for Svc6Key {}
// SAFETY: as above.
unsafe impl aya::Pod for Backend6 {}
// SAFETY: as above.
unsafe impl aya::Pod for RevNat6 {}
// SAFETY: as above.
unsafe impl aya::Pod for Ct6Key {}
// SAFETY: as above.
unsafe impl aya::Pod for Affinity6Key {}
// SAFETY: as above.
unsafe impl aya::Pod for Ct6Value {}
// SAFETY: as above.
unsafe impl aya::Pod for SourceRange6 {}
// SAFETY: as above.
unsafe impl aya::Pod for SockRevNat6Key {}
// SAFETY: as above.
unsafe impl aya::Pod for SockRevNat6Value {}
// SAFETY: as above.
unsafe impl aya::Pod for Frag6Key {}
