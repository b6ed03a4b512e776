#include "protocol/secagg_wire.h"

#include <kj/exception.h>

#include <bit>
#include <cstring>

namespace fedmesh::protocol {

static_assert(std::endian::native == std::endian::little, "masked words travel as little-endian uint32");

namespace {

using crypto::SecAggPhase;

kj::ArrayPtr<const kj::byte> bytes_of(std::span<const uint8_t> s) { return kj::arrayPtr(s.data(), s.size()); }

bool fail(Rejection& rejection, std::string reason) {
  rejection = {wire::RejectCode::MALFORMED, "secure aggregation: " + std::move(reason)};
  return false;
}

bool read_text(capnp::Text::Reader in, std::string& out, const char* what, Rejection& rejection) {
  if (in.size() > kMaxTextBytes) return fail(rejection, std::string(what) + " is longer than " + std::to_string(kMaxTextBytes) + " bytes");
  out.assign(in.cStr(), in.size());
  return true;
}

template <size_t N>
bool read_fixed(capnp::Data::Reader in, std::array<uint8_t, N>& out, const char* what, Rejection& rejection) {
  if (in.size() != N) {
    return fail(rejection, std::string(what) + " has " + std::to_string(in.size()) + " bytes, not " + std::to_string(N));
  }
  std::memcpy(out.data(), in.begin(), N);
  return true;
}

template <typename List>
bool bounded(List list, const char* what, Rejection& rejection) {
  if (list.size() > crypto::kMaxSecAggSites) {
    return fail(rejection, std::string(what) + " has " + std::to_string(list.size()) + " entries, more than " +
                               std::to_string(crypto::kMaxSecAggSites));
  }
  return true;
}

void fill(wire::SecAggAdvertisement::Builder b, const crypto::SecAggAdvertisement& a) {
  b.setSite(a.site);
  b.setCipherPublic(bytes_of(a.cipher_public));
  b.setMaskPublic(bytes_of(a.mask_public));
  b.setSignature(bytes_of(a.signature));
}

bool read(wire::SecAggAdvertisement::Reader r, crypto::SecAggAdvertisement& a, Rejection& rejection) {
  return read_text(r.getSite(), a.site, "a site name", rejection) &&
         read_fixed(r.getCipherPublic(), a.cipher_public, "a cipher key", rejection) &&
         read_fixed(r.getMaskPublic(), a.mask_public, "a mask key", rejection) &&
         read_fixed(r.getSignature(), a.signature, "a key signature", rejection);
}

void fill_shares(capnp::List<wire::SecAggShare>::Builder b, const std::vector<crypto::SecAggShareCipher>& shares) {
  for (size_t i = 0; i < shares.size(); ++i) {
    b[static_cast<unsigned>(i)].setFrom(shares[i].from);
    b[static_cast<unsigned>(i)].setTo(shares[i].to);
    b[static_cast<unsigned>(i)].setCiphertext(bytes_of(shares[i].ciphertext));
  }
}

bool read_shares(capnp::List<wire::SecAggShare>::Reader list, std::vector<crypto::SecAggShareCipher>& out,
                 Rejection& rejection) {
  if (!bounded(list, "a share list", rejection)) return false;
  for (auto s : list) {
    crypto::SecAggShareCipher c;
    if (!read_text(s.getFrom(), c.from, "a share's sender", rejection) ||
        !read_text(s.getTo(), c.to, "a share's recipient", rejection)) {
      return false;
    }
    const auto ciphertext = s.getCiphertext();  // read once: every get counts against the traversal limit
    if (ciphertext.size() > 1024) return fail(rejection, "a share of " + std::to_string(ciphertext.size()) + " bytes");
    c.ciphertext.assign(ciphertext.begin(), ciphertext.end());
    out.push_back(std::move(c));
  }
  return true;
}

bool read_names(capnp::List<capnp::Text>::Reader list, std::vector<std::string>& out, const char* what,
                Rejection& rejection) {
  if (!bounded(list, what, rejection)) return false;
  for (auto t : list) {
    std::string name;
    if (!read_text(t, name, what, rejection)) return false;
    out.push_back(std::move(name));
  }
  return true;
}

void fill_names(capnp::List<capnp::Text>::Builder b, const std::vector<std::string>& names) {
  for (size_t i = 0; i < names.size(); ++i) b.set(static_cast<unsigned>(i), names[i]);
}

}  // namespace

OutgoingMessage encode_secagg_up(const SecAggUpMessage& m, std::span<const uint32_t> words) {
  capnp::MallocMessageBuilder builder;
  auto up = builder.initRoot<wire::Message>().initSecAggUp();
  up.setRound(m.round);
  up.setSession(m.session);
  using K = SecAggUpMessage::Kind;
  switch (m.kind) {
    case K::kJoin: up.setJoin(); break;
    case K::kPoll: up.setPoll(); break;
    case K::kAdvertise: fill(up.initAdvertise(), m.advertisement); break;
    case K::kShares: fill_shares(up.initShares(static_cast<unsigned>(m.shares.size())), m.shares); break;
    case K::kMasked: {
      auto masked = up.initMasked();
      masked.setOffset(m.offset);
      const std::span<const uint32_t> w = words.empty() ? std::span<const uint32_t>(m.words) : words;
      auto data = masked.initWords(static_cast<unsigned>(w.size() * 4));
      if (!w.empty()) std::memcpy(data.begin(), w.data(), w.size() * 4);  // little-endian words (static_assert above)
      break;
    }
    case K::kConsistency: up.setConsistency(bytes_of(m.signature)); break;
    case K::kReveals: {
      auto list = up.initReveals(static_cast<unsigned>(m.reveals.size()));
      for (size_t i = 0; i < m.reveals.size(); ++i) {
        auto r = list[static_cast<unsigned>(i)];
        r.setOwner(m.reveals[i].owner);
        r.setMaskKey(m.reveals[i].mask_key);
        r.setPoint(m.reveals[i].share.x);
        r.setShare(bytes_of(m.reveals[i].share.y));
      }
      break;
    }
  }
  return serialize(builder);
}

bool decode_secagg_up(wire::SecAggUp::Reader in, SecAggUpMessage& out, Rejection& rejection) {
  try {
    out = SecAggUpMessage{};
    out.round = in.getRound();
    if (!read_text(in.getSession(), out.session, "the session id", rejection)) return false;
    using K = SecAggUpMessage::Kind;
    switch (in.which()) {
      case wire::SecAggUp::JOIN: out.kind = K::kJoin; return true;
      case wire::SecAggUp::POLL: out.kind = K::kPoll; return true;
      case wire::SecAggUp::ADVERTISE: out.kind = K::kAdvertise; return read(in.getAdvertise(), out.advertisement, rejection);
      case wire::SecAggUp::SHARES: out.kind = K::kShares; return read_shares(in.getShares(), out.shares, rejection);
      case wire::SecAggUp::MASKED: {
        out.kind = K::kMasked;
        const auto masked = in.getMasked();
        out.offset = masked.getOffset();
        const auto data = masked.getWords();
        if (data.size() % 4 != 0) return fail(rejection, "a masked input of " + std::to_string(data.size()) + " bytes, not whole words");
        out.words.resize(data.size() / 4);
        if (!out.words.empty()) std::memcpy(out.words.data(), data.begin(), data.size());
        return true;
      }
      case wire::SecAggUp::CONSISTENCY:
        out.kind = K::kConsistency;
        return read_fixed(in.getConsistency(), out.signature, "a consistency signature", rejection);
      case wire::SecAggUp::REVEALS: {
        out.kind = K::kReveals;
        const auto reveals = in.getReveals();
        if (!bounded(reveals, "a reveal list", rejection)) return false;
        for (auto r : reveals) {
          crypto::SecAggReveal reveal;
          if (!read_text(r.getOwner(), reveal.owner, "a share's owner", rejection)) return false;
          reveal.mask_key = r.getMaskKey();
          reveal.share.x = r.getPoint();
          if (!read_fixed(r.getShare(), reveal.share.y, "a revealed share", rejection)) return false;
          out.reveals.push_back(std::move(reveal));
        }
        return true;
      }
    }
    return fail(rejection, "an unknown kind of message");
  } catch (const kj::Exception& e) {
    return fail(rejection, std::string("does not parse: ") + e.getDescription().cStr());
  }
}

OutgoingMessage encode_secagg_down(const SecAggDownMessage& m) {
  capnp::MallocMessageBuilder builder;
  auto down = builder.initRoot<wire::Message>().initSecAggDown();
  down.setRound(m.round);
  down.setSession(m.session);
  down.setPhase(static_cast<wire::SecAggPhase>(m.phase));
  down.setMember(m.member);
  down.setAnswered(m.answered);
  down.setThreshold(m.threshold);
  down.setLength(m.length);
  down.setInvited(m.invited);
  down.setBaseVersion(m.base_version);
  down.setClip(m.clip);
  down.setFractionBits(m.fraction_bits);
  auto ads = down.initAdvertisements(static_cast<unsigned>(m.advertisements.size()));
  for (size_t i = 0; i < m.advertisements.size(); ++i) fill(ads[static_cast<unsigned>(i)], m.advertisements[i]);
  fill_shares(down.initShares(static_cast<unsigned>(m.shares.size())), m.shares);
  down.setMaskedNext(m.masked_next);
  fill_names(down.initAlive(static_cast<unsigned>(m.alive.size())), m.alive);
  fill_names(down.initDropped(static_cast<unsigned>(m.dropped.size())), m.dropped);
  auto sigs = down.initSignatures(static_cast<unsigned>(m.signatures.size()));
  for (size_t i = 0; i < m.signatures.size(); ++i) {
    sigs[static_cast<unsigned>(i)].setSite(m.signatures[i].site);
    sigs[static_cast<unsigned>(i)].setSignature(bytes_of(m.signatures[i].signature));
  }
  down.setReason(m.reason.substr(0, kMaxTextBytes));
  return serialize(builder);
}

bool decode_secagg_down(wire::SecAggDown::Reader in, SecAggDownMessage& out, Rejection& rejection) {
  try {
    out = SecAggDownMessage{};
    out.round = in.getRound();
    if (!read_text(in.getSession(), out.session, "the session id", rejection)) return false;
    const auto phase = static_cast<uint16_t>(in.getPhase());
    if (phase > static_cast<uint16_t>(SecAggPhase::kAborted)) return fail(rejection, "an unknown phase " + std::to_string(phase));
    out.phase = static_cast<SecAggPhase>(phase);
    out.member = in.getMember();
    out.answered = in.getAnswered();
    out.threshold = in.getThreshold();
    out.length = in.getLength();
    out.invited = in.getInvited();
    out.base_version = in.getBaseVersion();
    out.clip = in.getClip();
    out.fraction_bits = in.getFractionBits();
    out.masked_next = in.getMaskedNext();
    const auto advertisements = in.getAdvertisements();
    if (!bounded(advertisements, "the key list", rejection)) return false;
    for (auto a : advertisements) {
      crypto::SecAggAdvertisement ad;
      if (!read(a, ad, rejection)) return false;
      out.advertisements.push_back(std::move(ad));
    }
    if (!read_shares(in.getShares(), out.shares, rejection)) return false;
    if (!read_names(in.getAlive(), out.alive, "the survivors", rejection)) return false;
    if (!read_names(in.getDropped(), out.dropped, "the dropped sites", rejection)) return false;
    const auto signatures = in.getSignatures();
    if (!bounded(signatures, "the signature list", rejection)) return false;
    for (auto s : signatures) {
      crypto::SecAggSignature sig;
      if (!read_text(s.getSite(), sig.site, "a signer", rejection) ||
          !read_fixed(s.getSignature(), sig.signature, "a consistency signature", rejection)) {
        return false;
      }
      out.signatures.push_back(std::move(sig));
    }
    return read_text(in.getReason(), out.reason, "the reason", rejection);
  } catch (const kj::Exception& e) {
    return fail(rejection, std::string("does not parse: ") + e.getDescription().cStr());
  }
}

}  // namespace fedmesh::protocol
