//! The state of a cluster member, as a node's failure detector sees it: one type for the
//! gossip layer (`fallow-cluster`), the wire (`fallow-proto`'s MEMBERS reply, whose state
//! byte is the discriminant) and everything that shows or acts on it.

/// Whether a member can be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum MemberState {
    /// Live and heard of recently.
    Alive = 0,
    /// Live for the failure detector, but silent for longer than its suspicion time.
    /// Either it recovers (back to `Alive`) or the detector declares it `Dead`.
    Suspect = 1,
    /// Declared failed by the detector, or left. A dead member that is heard of again (a
    /// healed partition) becomes `Alive`; a restart shows as a new generation.
    Dead = 2,
}

impl MemberState {
    /// Every state, in code order.
    pub const ALL: [MemberState; 3] = [MemberState::Alive, MemberState::Suspect, MemberState::Dead];

    /// The state whose code (the discriminant, as sent on the wire) is `code`, if any.
    pub fn from_code(code: u8) -> Option<MemberState> {
        MemberState::ALL.into_iter().find(|s| *s as u8 == code)
    }

    /// A lower-case name for logs, metrics labels and JSON.
    pub fn name(self) -> &'static str {
        match self {
            MemberState::Alive => "alive",
            MemberState::Suspect => "suspect",
            MemberState::Dead => "dead",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_codes_are_none() {
        for s in MemberState::ALL {
            assert_eq!(MemberState::from_code(s as u8), Some(s));
        }
        assert_eq!(MemberState::from_code(3), None);
    }
}
