package dedupweb

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// tokenTTL is how long a confirmation page's CSRF token stays valid.
const tokenTTL = time.Hour

// token returns the CSRF token of a form: the time it was made and an
// HMAC, under the handler's random secret, of that time, the action and
// its subject (the lock key and holder), so a token opens only the form it
// was made for.
func (h *Handler) token(action, subject string) string {
	ts := strconv.FormatInt(h.now().Unix(), 10)
	return ts + "." + h.mac(ts, action, subject)
}

func (h *Handler) mac(ts, action, subject string) string {
	m := hmac.New(sha256.New, h.secret)
	m.Write([]byte(ts + "\x00" + action + "\x00" + subject))
	return hex.EncodeToString(m.Sum(nil))
}

// checkToken refuses a POST whose token is missing, forged, made for
// another form, or older than tokenTTL; and one whose Origin (or, without
// it, Referer) names another host.
func (h *Handler) checkToken(r *http.Request, action, subject string) error {
	if err := sameOrigin(r); err != nil {
		return err
	}
	tok := r.PostFormValue("csrf")
	ts, sum, ok := strings.Cut(tok, ".")
	if tok == "" || !ok {
		return &httpError{http.StatusForbidden, "refused: the form has no CSRF token (submit it from its confirmation page)"}
	}
	want := h.mac(ts, action, subject)
	if !hmac.Equal([]byte(sum), []byte(want)) {
		return &httpError{http.StatusForbidden, "refused: bad CSRF token (reload the confirmation page and submit it again)"}
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if age := h.now().Sub(time.Unix(sec, 0)); err != nil || age > tokenTTL || age < -time.Minute {
		return &httpError{http.StatusForbidden, "refused: the CSRF token has expired (reload the confirmation page)"}
	}
	return nil
}

// sameOrigin checks the Origin header, or the Referer without it, against
// the request's host, when the browser sent one.
func sameOrigin(r *http.Request) error {
	src := r.Header.Get("Origin")
	if src == "" || src == "null" {
		src = r.Header.Get("Referer")
	}
	if src == "" {
		return nil
	}
	u, err := url.Parse(src)
	if err != nil || !strings.EqualFold(u.Host, r.Host) {
		return &httpError{http.StatusForbidden, "refused: the form was posted from another site (" + src + ")"}
	}
	return nil
}
